"""Production settings as an operator meets them: the default settings module is production
(DEBUG off, SECRET_KEY and ALLOWED_HOSTS required), ``check --deploy`` is clean, gunicorn
serves the app with the security headers and static files, and no page needs inline script
or style under the Content-Security-Policy."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from django.conf import settings

from tests.runs.workerprocs import wait_for

BASE = Path(settings.BASE_DIR)
MANAGE = str(BASE / "manage.py")
GUNICORN = str(Path(sys.executable).parent / "gunicorn")
SECRET = "x7Qe-0b9Lk2mZr8Vt4Hs6Nw1Jc3Pf5Gd7Ya9Ub2Ie4Oq6Kx8Tn0Rl3Sj5Wm7Zp9Dv"


def production_env(tmp_path: Path, **overrides: str) -> dict[str, str]:
    """What an operator sets: nothing from the developer's or the test's environment."""
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "HOME": str(tmp_path),
        "DJANGO_SETTINGS_MODULE": "agentops.settings",
        "SECRET_KEY": SECRET,
        "ALLOWED_HOSTS": "agentops.example.com",
        "DATABASE_URL": f"sqlite:///{tmp_path / 'prod.sqlite3'}",
        "AGENTOPS_VAR_DIR": str(tmp_path / "var"),
    }
    env.update(overrides)
    return {key: value for key, value in env.items() if value is not None}


def manage(env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, MANAGE, *args],
        cwd=BASE,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_check_deploy_is_clean_with_production_settings(tmp_path):
    result = manage(production_env(tmp_path), "check", "--deploy", "--fail-level", "WARNING")

    assert result.returncode == 0, result.stdout + result.stderr
    assert "System check identified no issues" in result.stdout


def test_check_deploy_requires_the_base_url_of_links_when_email_is_sent(tmp_path):
    smtp = "django.core.mail.backends.smtp.EmailBackend"
    result = manage(production_env(tmp_path, EMAIL_BACKEND=smtp), "check", "--deploy")

    assert result.returncode != 0
    assert "agentops.E001" in result.stderr and "AGENTOPS_BASE_URL" in result.stderr

    http = production_env(
        tmp_path, EMAIL_BACKEND=smtp, AGENTOPS_BASE_URL="http://agentops.example.com"
    )
    result = manage(http, "check", "--deploy", "--fail-level", "WARNING")
    assert result.returncode != 0 and "agentops.W001" in result.stderr

    https = production_env(
        tmp_path, EMAIL_BACKEND=smtp, AGENTOPS_BASE_URL="https://agentops.example.com"
    )
    result = manage(https, "check", "--deploy", "--fail-level", "WARNING")
    assert result.returncode == 0, result.stdout + result.stderr


def test_production_is_the_default_and_refuses_to_start_without_a_secret_key(tmp_path):
    env = production_env(tmp_path)
    del env["SECRET_KEY"]

    result = manage(env, "check")

    assert result.returncode != 0
    assert "environment variable SECRET_KEY is required" in result.stderr


def test_production_refuses_to_start_without_allowed_hosts(tmp_path):
    env = production_env(tmp_path)
    del env["ALLOWED_HOSTS"]

    result = manage(env, "check")

    assert result.returncode != 0
    assert "ALLOWED_HOSTS is required when DEBUG=0" in result.stderr


@pytest.mark.parametrize(
    ("variable", "value", "message"),
    [
        ("LOG_FORMAT", "xml", "LOG_FORMAT='xml': use json or human"),
        ("AGENTOPS_LLM_INPUT_PRICE", "cheap", "AGENTOPS_LLM_INPUT_PRICE='cheap' is not a decimal"),
        ("AGENTOPS_METRICS_ALLOWED_NETWORKS", "10.0.0.0/33", "AGENTOPS_METRICS_ALLOWED_NETWORKS"),
        ("AGENTOPS_MCP_HOLD_SECONDS", "90", "AGENTOPS_MCP_HOLD_SECONDS must be more than 0"),
    ],
)
def test_a_bad_setting_stops_the_process_with_its_name(tmp_path, variable, value, message):
    result = manage(production_env(tmp_path, **{variable: value}), "check")

    assert result.returncode != 0
    assert message in result.stderr.strip().splitlines()[-1]


def test_production_defaults_are_secure(tmp_path):
    script = (
        "from django.conf import settings as s; "
        "print(s.DEBUG, s.SESSION_COOKIE_SECURE, s.CSRF_COOKIE_SECURE, s.SECURE_SSL_REDIRECT, "
        "s.SECURE_HSTS_SECONDS, s.LOGGING['handlers']['console']['formatter'])"
    )

    result = manage(production_env(tmp_path), "shell", "-c", script)

    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[-1].split() == [
        "False",
        "True",
        "True",
        "True",
        "31536000",
        "json",
    ]


def test_a_development_machine_opts_into_debug(tmp_path):
    env = production_env(tmp_path, DEBUG="1", SECRET_KEY=None, ALLOWED_HOSTS=None)
    script = "from django.conf import settings as s; print(s.DEBUG, s.SECURE_SSL_REDIRECT)"

    result = manage(env, "shell", "-c", script)

    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[-1].split() == ["True", "False"]


# --- gunicorn, as deploy/ and the Procfile run it ------------------------------------------------


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture
def gunicorn(tmp_path):
    port = _free_port()
    env = production_env(
        tmp_path,
        GUNICORN_BIND=f"127.0.0.1:{port}",
        GUNICORN_WORKERS="1",
        GUNICORN_THREADS="2",
        SECURE_PROXY_SSL_HEADER="X-Forwarded-Proto",
    )
    migrated = manage(env, "migrate", "--noinput")
    assert migrated.returncode == 0, migrated.stderr
    log = open(tmp_path / "gunicorn.log", "wb")  # noqa: SIM115 (closed below)
    process = subprocess.Popen(
        [GUNICORN, "-c", "deploy/gunicorn.conf.py", "agentops.wsgi"],
        cwd=BASE,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    url = f"http://127.0.0.1:{port}"

    def up() -> bool:
        assert process.poll() is None, (tmp_path / "gunicorn.log").read_text()
        try:
            return httpx.get(f"{url}/healthz", timeout=2).status_code == 200
        except httpx.TransportError:
            return False

    try:
        wait_for(up, 60, what="gunicorn to serve /healthz")
        yield url
    finally:
        # SIGTERM to the master: a graceful stop, as systemd's KillMode=mixed sends it
        process.terminate()
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, 9)
            process.wait()
        log.close()


@pytest.mark.slow
def test_gunicorn_serves_the_app_with_production_security(gunicorn, tmp_path):
    host = {"Host": "agentops.example.com"}
    via_https_proxy = {**host, "X-Forwarded-Proto": "https"}

    # probes reach /healthz over plain http on an internal address
    health = httpx.get(f"{gunicorn}/healthz", timeout=5)
    assert health.json() == {"status": "ok", "database": "ok"}
    # everything else is https only
    plain = httpx.get(f"{gunicorn}/accounts/login/", headers=host, timeout=5)
    assert plain.status_code == 301
    assert plain.headers["location"] == "https://agentops.example.com/accounts/login/"
    # behind the TLS proxy: the page, with HSTS, secure cookies and the CSP
    page = httpx.get(f"{gunicorn}/accounts/login/", headers=via_https_proxy, timeout=5)
    assert page.status_code == 200
    assert page.headers["strict-transport-security"].startswith("max-age=31536000")
    csp = page.headers["content-security-policy"]
    assert "script-src 'self'" in csp and "style-src 'self'" in csp
    assert "unsafe-inline" not in csp
    assert "secure" in page.headers["set-cookie"].lower()
    # static files come from the app server itself (WhiteNoise)
    htmx = httpx.get(f"{gunicorn}/static/js/htmx.min.js", headers=via_https_proxy, timeout=5)
    assert htmx.status_code == 200 and len(htmx.content) > 10_000
    # a host it does not serve
    evil = {"Host": "evil.test", "X-Forwarded-Proto": "https"}
    assert httpx.get(f"{gunicorn}/accounts/login/", headers=evil).status_code == 400
    # but probes and scrapers address the machine by IP, which is not an allowed host
    assert httpx.get(f"{gunicorn}/metrics", timeout=5).status_code == 200

    # the access log keeps no link token (issue 17): request lines, Referers, next=
    token = "Tk" + "x" * 41  # the shape of a link token
    for path in (f"/approvals/link/{token}/", f"/questions/link/{token}/"):
        referer = {"Referer": f"https://agentops.example.com{path}"}
        httpx.get(f"{gunicorn}{path}", headers={**via_https_proxy, **referer}, timeout=5)
    login = f"{gunicorn}/accounts/login/?next=%2Fapprovals%2Flink%2F{token}%2F"
    httpx.get(login, headers=via_https_proxy, timeout=5)
    log = (tmp_path / "gunicorn.log").read_text()
    assert "/approvals/link/[redacted]/" in log
    assert token not in log


# --- the Content-Security-Policy ----------------------------------------------------------------

INLINE_SCRIPT = re.compile(r"<script(?![^>]*\bsrc=)[^>]*>", re.IGNORECASE)
INLINE_STYLE = re.compile(r"<style\b|\sstyle\s*=", re.IGNORECASE)
HANDLER_ATTRIBUTE = re.compile(r"\son[a-z]+\s*=\s*[\"']", re.IGNORECASE)


def _page_templates() -> list[Path]:
    # e-mail bodies are not pages (no CSP applies to them; mail clients need inline style)
    return [
        path
        for path in (BASE / "templates").rglob("*.html")
        if "email" not in path.relative_to(BASE / "templates").parts
    ]


@pytest.mark.parametrize(
    "path", _page_templates(), ids=lambda p: str(p.relative_to(BASE / "templates"))
)
def test_no_page_template_has_inline_script_or_style(path):
    source = path.read_text()

    assert not INLINE_SCRIPT.search(source), "inline <script>: move it to static/js/"
    assert not INLINE_STYLE.search(source), "inline style: move it to static/css/"
    assert not HANDLER_ATTRIBUTE.search(source), "on* handler attribute: use static/js/"


def _htmx_config() -> dict:
    base = (BASE / "templates" / "base.html").read_text()
    (config,) = re.findall(r"""<meta name="htmx-config" content='([^']*)'>""", base)
    return json.loads(config)


def test_htmx_is_told_not_to_inject_its_indicator_styles():
    assert _htmx_config()["includeIndicatorStyles"] is False


def test_htmx_does_not_settle_style_attributes():
    # htmx copies a settled attribute from the old element onto its swapped-in successor
    # with setAttribute: for "style" (its default list has it) that is inline style, which
    # the policy blocks and reports whenever script had styled the old element
    assert "style" not in _htmx_config()["attributesToSettle"]


@pytest.mark.django_db
def test_pages_carry_the_content_security_policy(client):
    response = client.get("/accounts/login/")

    csp = response["Content-Security-Policy"]
    directives = dict(part.strip().split(" ", 1) for part in csp.split(";"))
    assert directives["script-src"] == "'self'"
    assert directives["style-src"] == "'self'"
    assert directives["object-src"] == "'none'"
    assert directives["frame-ancestors"] == "'none'"


@pytest.mark.django_db
def test_swagger_ui_is_served_without_inline_script_or_style(client):
    page = client.get("/api/docs/")

    html = page.content.decode()
    assert page.status_code == 200
    assert not INLINE_SCRIPT.search(html)
    assert not INLINE_STYLE.search(html)
    # its own start-up script comes from a URL the CSP allows ('self')
    script_url = re.findall(r'<script src="(/api/docs/\?script=[^"]*)"', html)
    assert script_url
    script = client.get(script_url[0])
    assert script.status_code == 200
    assert "SwaggerUIBundle" in script.content.decode()


def test_procfile_runs_gunicorn_with_the_deploy_config_and_a_worker():
    processes = dict(
        line.split(":", 1) for line in (BASE / "Procfile").read_text().splitlines() if line
    )

    assert processes["web"].split()[:3] == ["gunicorn", "-c", "deploy/gunicorn.conf.py"]
    assert "manage.py runworker" in processes["worker"]
    # no worker, no sweeper: something else must notice that no worker is alive
    assert "manage.py check_alerts --every" in processes["alerts"]
    # held MCP calls wait in their own process, never in gunicorn's slots (docs/mcp.md)
    assert "manage.py runmcp" in processes["mcp"]
    unit = (BASE / "deploy" / "agentops-mcp.service").read_text()
    assert "ExecStart=/srv/agentops/.venv/bin/python manage.py runmcp" in unit


@pytest.mark.parametrize("unit", ["agentops-worker.service", "agentops-worker@.service"])
def test_the_worker_units_stop_django_q2_the_way_it_needs(unit):
    lines = {
        key: value
        for key, _, value in (
            line.partition("=") for line in (BASE / "deploy" / unit).read_text().splitlines()
        )
        if not key.startswith("#")
    }

    # SIGTERM to the main process only, then SIGKILL for the whole group if it hangs
    assert lines["KillSignal"] == "SIGTERM"
    assert lines["KillMode"] == "mixed"
    assert int(lines["TimeoutStopSec"]) > 30
    assert "manage.py runworker --name" in lines["ExecStart"]


def test_gunicorn_config_loads(tmp_path):
    result = subprocess.run(
        [GUNICORN, "--check-config", "-c", "deploy/gunicorn.conf.py", "agentops.wsgi"],
        cwd=BASE,
        env=production_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=120,
    )

    assert result.returncode == 0, result.stdout + result.stderr

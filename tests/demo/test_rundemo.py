"""``manage.py rundemo`` as a user runs it: a real supervisor with a real web server, worker
and sandbox, against its own SQLite file and free ports.

It must show demo runs succeeding on the page, and one Ctrl-C (SIGINT to the supervisor)
must leave no process behind within 10 s; if a child dies, the rest are stopped and the
command fails.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import sqlite3
import subprocess
import sys
import time
from contextlib import suppress
from pathlib import Path

import httpx
import pytest
from django.core.management import CommandError, call_command

from agentops.demo.sandbox import free_port

REPO = Path(__file__).resolve().parents[2]


class Demo:
    def __init__(self, tmp_path: Path) -> None:
        self.var_dir = tmp_path / "var"
        self.db_path = tmp_path / "demo.sqlite3"
        self.log_path = tmp_path / "rundemo.out"
        self.web_port = free_port()
        self.sandbox_port = free_port()
        self.mcp_port = free_port()
        env = {
            **os.environ,
            "DATABASE_URL": f"sqlite:///{self.db_path}",
            "AGENTOPS_VAR_DIR": str(self.var_dir),
            "DJANGO_SETTINGS_MODULE": "tests.settings",
            "PYTHONUNBUFFERED": "1",
            # as `make run`: emails printed to the worker's log, links to the given port
            "EMAIL_BACKEND": "django.core.mail.backends.console.EmailBackend",
        }
        env.pop("AGENTOPS_CRASH_AT", None)
        env.pop("AGENTOPS_BASE_URL", None)
        with open(self.log_path, "wb") as out:
            self.process = subprocess.Popen(
                [
                    sys.executable,
                    "manage.py",
                    "rundemo",
                    "--port",
                    str(self.web_port),
                    "--sandbox-port",
                    str(self.sandbox_port),
                    "--mcp-port",
                    str(self.mcp_port),
                ],
                cwd=REPO,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self.url = f"http://127.0.0.1:{self.web_port}"

    def output(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_for_output(self, pattern: str, timeout: float = 60) -> re.Match[str]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = re.search(pattern, self.output())
            if found:
                return found
            if self.process.poll() is not None:
                break
            time.sleep(0.1)
        raise AssertionError(f"no {pattern!r} in rundemo's output:\n{self.output()}")

    def processes(self) -> list[int]:
        """Every live process started for this demo (they all carry its var dir)."""
        marker = f"AGENTOPS_VAR_DIR={self.var_dir}\0".encode()
        pids = []
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            with suppress(OSError):
                environ = (entry / "environ").read_bytes()
                status = (entry / "stat").read_text()
                # a zombie has already exited; it only waits for its parent to reap it
                if marker in environ and status.rsplit(")", 1)[1].split()[0] != "Z":
                    pids.append(int(entry.name))
        return pids

    def cleanup(self) -> None:
        for pid in [self.process.pid, *self.processes()]:
            with suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        with suppress(subprocess.TimeoutExpired):
            self.process.wait(timeout=5)

    def sign_in(self, password: str) -> httpx.Client:
        client = httpx.Client(base_url=self.url, follow_redirects=True, timeout=5)
        page = client.get("/accounts/login/")
        token = re.search(r'name="csrfmiddlewaretoken" value="([^"]+)"', page.text).group(1)
        signed_in = client.post(
            "/accounts/login/",
            data={"username": "demo", "password": password, "csrfmiddlewaretoken": token},
        )
        assert signed_in.url.path == "/", signed_in.text
        return client

    def worker_health(self) -> list[str]:
        with sqlite3.connect(self.db_path) as db:
            return [row[0] for row in db.execute("SELECT health FROM runs_worker")]


def _port_free(port: int) -> bool:
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _wait_until_gone(demo: Demo, started: float, within: float) -> list[int]:
    left = demo.processes()
    while left and time.monotonic() - started < within:
        time.sleep(0.1)
        left = demo.processes()
    return left


@pytest.fixture
def demo(tmp_path):
    demo = Demo(tmp_path)
    yield demo
    demo.cleanup()


@pytest.mark.slow
def test_demo_runs_succeed_and_one_ctrl_c_stops_everything(demo):
    password = demo.wait_for_output(r"sign in\s+user demo, password (\S+)").group(1)
    demo.wait_for_output(r"Press Ctrl-C")
    assert len(demo.processes()) >= 4  # supervisor, sandbox, worker (+ its cluster), web

    client = demo.sign_in(password)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        page = client.get("/runs/?status=succeeded", headers={"HX-Request": "true"}).text
        waiting = client.get("/runs/?status=waiting_approval", headers={"HX-Request": "true"}).text
        if 'badge-succeeded">succeeded</span></td>' in page and "needs an approver" in waiting:
            break
        time.sleep(0.3)
    else:
        raise AssertionError(f"no demo run succeeded:\n{page}\n{demo.output()}")
    assert "refund" in page
    # the approval email (printed to the worker's log) links to this demo's port, and opens
    worker_log = demo.var_dir / "log" / "worker.log"
    link_in_log = re.compile(r"(http://127\.0\.0\.1:(\d+)(/approvals/link/[\w-]+/))")
    deadline = time.monotonic() + 20  # sent right after the commit that parked the run
    while not (links := link_in_log.findall(worker_log.read_text())):
        assert time.monotonic() < deadline, worker_log.read_text()[-2000:]
        time.sleep(0.2)
    assert {port for _, port, _ in links} == {str(demo.web_port)}
    assert f"emailed links open {demo.url}" in demo.output()
    opened = client.get(links[0][2])
    assert opened.status_code == 200 and 'name="decision"' in opened.text, opened.text[-500:]

    started = time.monotonic()
    demo.process.send_signal(signal.SIGINT)
    assert demo.process.wait(timeout=10) == 0, demo.output()
    left = _wait_until_gone(demo, started, within=10)
    assert left == [], f"still running after Ctrl-C: {left}"
    assert time.monotonic() - started < 10
    assert _port_free(demo.web_port) and _port_free(demo.sandbox_port)
    assert _port_free(demo.mcp_port)
    # the worker stopped cleanly (released its identity) rather than being killed
    assert demo.worker_health() == ["stopped"]
    assert "stopped: web server, worker and sandbox" in demo.output()


@pytest.mark.slow
def test_a_child_that_dies_stops_the_others_and_fails(demo):
    pids = demo.wait_for_output(r"pids\s+sandbox (\d+), worker (\d+), web (\d+)")
    sandbox_pid = int(pids.group(1))

    started = time.monotonic()
    os.kill(sandbox_pid, signal.SIGKILL)
    assert demo.process.wait(timeout=10) == 1
    assert "the sandbox exited unexpectedly" in demo.output()
    left = _wait_until_gone(demo, started, within=10)
    assert left == [], f"still running after the sandbox died: {left}"


def test_a_port_in_use_is_a_clear_error():
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(CommandError, match=f"port {port} on 127.0.0.1 is in use"):
            call_command("rundemo", "--port", str(port), "--sandbox-port", str(free_port()))

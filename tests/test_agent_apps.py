"""A third-party agent app is installed through ``AGENTOPS_APPS`` (docs/agents.md,
"Registering"), without editing settings.py: its agents run like the demo's, and a name that
cannot be imported is one clear line."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.test_deploy import MANAGE, production_env


def _manage(tmp_path: Path, *args: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, MANAGE, *args],
        cwd=Path(MANAGE).parent,
        env=production_env(tmp_path, DEBUG="1", PYTHONPATH=str(Path(MANAGE).parent), **env),
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_an_app_named_in_agentops_apps_registers_agents_that_run(tmp_path):
    apps = {"AGENTOPS_APPS": "tests.thirdparty"}
    migrated = _manage(tmp_path, "migrate", "--noinput", **apps)
    assert migrated.returncode == 0, migrated.stderr

    started = _manage(
        tmp_path, "startrun", "thirdparty_greeter", "--input", '{"name": "ada"}', **apps
    )
    assert started.returncode == 0, started.stderr
    run_id = started.stdout.strip().splitlines()[-1]
    driven = _manage(
        tmp_path,
        "shell",
        "-c",
        "from runs import engine; from runs.models import Run; import json; "
        f"engine.advance('{run_id}', worker='t'); r = Run.objects.get(id='{run_id}'); "
        "print(json.dumps([r.status, r.result]))",
        **apps,
    )
    assert driven.returncode == 0, driven.stderr
    assert json.loads(driven.stdout.strip().splitlines()[-1]) == [
        "succeeded",
        {"greeting": "hello ada"},
    ]


def test_an_app_that_cannot_be_imported_is_one_clear_line(tmp_path):
    result = _manage(tmp_path, "check", AGENTOPS_APPS="billing_agents")

    assert result.returncode != 0
    assert (
        "AGENTOPS_APPS names billing_agents, which cannot be imported "
        "(installed in this virtualenv, or on PYTHONPATH?)"
    ) in result.stderr

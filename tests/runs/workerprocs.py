"""Real ``runworker`` processes for tests: started in their own process group against the
TEST database (``agentops.workerprocs``, the helper the benchmark and chaos use too), and
always stopped (SIGKILL of the whole group) when the test ends."""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from agentops.demo.management.commands.chaos import database_url
from agentops.workerprocs import MANAGE, WorkerProcess

__all__ = ["MANAGE", "WorkerProcess", "Workers", "one_line", "wait_for", "worker_env"]


def worker_env(sandbox: Any = None, **overrides: str) -> dict[str, str]:
    """The test process's environment (its short TTLs come from tests/settings.py), pointed
    at the test database: pytest-django renamed it in the live settings only."""
    env = dict(os.environ)
    env.pop("AGENTOPS_CRASH_AT", None)
    env.pop("AGENTOPS_PAUSE_AT", None)
    env.update(
        {
            "DJANGO_SETTINGS_MODULE": "tests.settings",
            "DATABASE_URL": database_url(),
            "PYTHONUNBUFFERED": "1",
            "LOG_LEVEL": "WARNING",
        }
    )
    if sandbox is not None:
        env["AGENTOPS_SANDBOX_URL"] = sandbox.url
    env.update(overrides)
    return env


class Workers:
    """Starts workers for one test and kills whatever is left of them afterwards."""

    def __init__(self, tmp_path: Path) -> None:
        self.tmp_path = tmp_path
        self.started: list[WorkerProcess] = []

    def start(self, name: str, env: dict[str, str], prefix: Sequence[str] = ()) -> WorkerProcess:
        log_path = self.tmp_path / f"{name}.{len(self.started)}.log"
        worker = WorkerProcess(name, env, log_path, prefix=prefix)
        self.started.append(worker)
        return worker

    def cleanup(self) -> None:
        for worker in self.started:
            worker.kill_group()


def wait_for(predicate: Callable[[], Any], timeout: float, *, what: str = "condition") -> Any:
    end = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > end:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.05)


def one_line(text: str) -> str:
    lines = [line for line in text.splitlines() if line.strip()]
    assert len(lines) == 1, f"expected one line, got:\n{text}"
    return lines[0]

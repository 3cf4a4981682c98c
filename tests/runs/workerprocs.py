"""Real ``runworker`` processes for tests: started in their own process group against the
TEST database, and always stopped (SIGKILL of the whole group) when the test ends."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from contextlib import suppress
from pathlib import Path
from typing import Any

from django.conf import settings

from agentops.demo.management.commands.chaos import database_url

MANAGE = str(Path(settings.BASE_DIR) / "manage.py")


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


class WorkerProcess:
    def __init__(
        self, name: str, env: dict[str, str], log_path: Path, prefix: Sequence[str] = ()
    ) -> None:
        self.name = name
        self.log_path = log_path
        with open(log_path, "wb") as log:
            self.process = subprocess.Popen(
                # prefix: e.g. `ip netns exec <host>`, which execs the worker (same pid)
                [*prefix, sys.executable, MANAGE, "runworker", "--name", name],
                cwd=settings.BASE_DIR,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def alive(self) -> bool:
        return self.process.poll() is None

    def output(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_running(self, timeout: float = 20) -> None:
        wait_for(
            lambda: f"worker {self.name} running" in self.output() or not self.alive,
            timeout,
            what=f"worker {self.name} to start",
        )
        assert self.alive, self.output()

    def wait_exit(self, timeout: float, *, during: Callable[[], Any] | None = None) -> int:
        end = time.monotonic() + timeout
        while self.alive:
            assert time.monotonic() < end, f"{self.name} still running:\n{self.output()}"
            if during is not None:
                during()
            time.sleep(0.05)
        return self.process.returncode

    def group_alive(self) -> bool:
        try:
            os.killpg(self.pid, 0)
        except ProcessLookupError:
            return False
        return True

    def frozen(self) -> bool:
        """The main process is stopped (SIGSTOP, e.g. by AGENTOPS_PAUSE_AT)."""
        try:
            stat = Path(f"/proc/{self.pid}/stat").read_text()
        except OSError:
            return False
        return stat.rsplit(")", 1)[-1].split()[0] in ("T", "t")

    def resume(self) -> None:
        """SIGCONT to the whole process group, as whoever froze it would."""
        os.killpg(self.pid, signal.SIGCONT)

    def kill_group(self) -> None:
        with suppress(ProcessLookupError):
            os.killpg(self.pid, signal.SIGKILL)
        self.process.wait()  # reaped: a zombie would still look alive to its successor


class Workers:
    """Starts workers for one test and kills whatever is left of them afterwards."""

    def __init__(self, tmp_path: Path) -> None:
        self.tmp_path = tmp_path
        self.started: list[WorkerProcess] = []

    def start(self, name: str, env: dict[str, str], prefix: Sequence[str] = ()) -> WorkerProcess:
        log_path = self.tmp_path / f"{name}.{len(self.started)}.log"
        worker = WorkerProcess(name, env, log_path, prefix)
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

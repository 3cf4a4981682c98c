"""Worker subprocesses, one helper for whoever starts them: the benchmark (``agentops.bench``),
the chaos harness (``agentops.demo``'s ``chaos``) and the tests (``tests/runs/workerprocs.py``).

A worker is ``manage.py runworker --name NAME`` (or a command that ends in it, such as
``bench --worker``) in its own process group, so a crash is a SIGKILL of the whole group, as
in production (DESIGN §4), and its output goes to a log file. Stopping follows RECIPES: SIGTERM
to the main process only (django-q2 hangs on a group SIGTERM), then SIGKILL of whatever is
left of the group. Imports neither pytest nor anything of the tests.
"""

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

MANAGE = str(Path(settings.BASE_DIR) / "manage.py")


class WorkerFailed(RuntimeError):
    """A worker exited or did not start in time."""


def spawn(
    args: Sequence[str], *, env: dict[str, str], log_path: Path, prefix: Sequence[str] = ()
) -> subprocess.Popen[bytes]:
    """``manage.py <args>`` in its own process group (``start_new_session``), stdin closed,
    stdout and stderr to ``log_path``. ``prefix`` runs it through another command that execs
    it (same pid), e.g. ``ip netns exec <host>``."""
    with open(log_path, "wb") as log:
        return subprocess.Popen(
            [*prefix, sys.executable, MANAGE, *args],
            cwd=settings.BASE_DIR,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


def frozen(pid: int) -> bool:
    """The process is stopped (SIGSTOP, e.g. by ``AGENTOPS_PAUSE_AT``): state T in /proc."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[-1].split()[0] in ("T", "t")


class WorkerProcess:
    """One worker process, started at once: ``runworker --name NAME`` unless ``command``
    says otherwise."""

    def __init__(
        self,
        name: str,
        env: dict[str, str],
        log_path: Path,
        *,
        command: Sequence[str] | None = None,
        prefix: Sequence[str] = (),
    ) -> None:
        self.name = name
        self.log_path = log_path
        self.started_at = time.time()
        self.process = spawn(
            command if command is not None else ["runworker", "--name", name],
            env=env,
            log_path=log_path,
            prefix=prefix,
        )

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def alive(self) -> bool:
        return self.process.poll() is None

    def output(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def wait_running(self, timeout: float = 60) -> None:
        """Until the worker logs that it runs; ``WorkerFailed`` if it exits or takes longer."""
        end = time.monotonic() + timeout
        while f"worker {self.name} running" not in self.output():
            if not self.alive:
                raise WorkerFailed(f"worker {self.name} exited:\n{self.output()[-2000:]}")
            if time.monotonic() > end:
                raise WorkerFailed(f"worker {self.name} did not start in {timeout:.0f}s")
            time.sleep(0.05)

    def wait_exit(self, timeout: float, *, during: Callable[[], Any] | None = None) -> int:
        """Until the main process exits (``during`` is called meanwhile); its return code."""
        end = time.monotonic() + timeout
        while self.alive:
            if time.monotonic() > end:
                raise WorkerFailed(f"{self.name} still running:\n{self.output()}")
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
        return frozen(self.pid)

    def resume(self) -> None:
        """SIGCONT to the whole process group, as whoever froze it would."""
        os.killpg(self.pid, signal.SIGCONT)

    def stop(self, timeout: float = 60) -> None:
        """SIGTERM to the main process only, then SIGKILL of whatever is left of the group
        (orphaned cluster children) once it exited or ``timeout`` passed."""
        if self.alive:
            with suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGTERM)
            with suppress(subprocess.TimeoutExpired):
                self.process.wait(timeout)
        self.kill_group()

    def kill_group(self, timeout: float | None = None) -> None:
        """A crash: SIGKILL of the whole process group, and the main process reaped (a zombie
        would still look alive to its successor)."""
        with suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pid, signal.SIGKILL)
        with suppress(subprocess.TimeoutExpired):
            self.process.wait(timeout)

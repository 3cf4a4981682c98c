"""A small process supervisor for ``rundemo``: start children, notice deaths, stop them all.

Each child runs in its own session (``start_new_session=True``): a Ctrl-C in the terminal
reaches only the supervisor, which then stops the children in an order it controls.

Stopping follows what django-q2 needs (see docs/operations.md): SIGTERM goes to each child's
MAIN process only — SIGTERM to a django-q2 cluster's whole process group hangs it for about
90 s — and the process groups of children still alive after the grace period are SIGKILLed.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Callable
from contextlib import suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO


@dataclass
class Child:
    name: str
    argv: list[str]
    log_path: Path | None = None  # None: share the supervisor's terminal
    process: subprocess.Popen[bytes] | None = field(default=None, repr=False)

    @property
    def pid(self) -> int:
        assert self.process is not None
        return self.process.pid

    def main_alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def group_alive(self) -> bool:
        """Whether any process of this child's group (it leads its own) still exists."""
        if self.process is None:
            return False
        try:
            os.killpg(self.pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True

    def gone(self) -> bool:
        # poll() first: it reaps the main process, which otherwise lingers as a zombie
        return not self.main_alive() and not self.group_alive()

    def log_tail(self, lines: int = 15) -> str:
        if self.log_path is None or not self.log_path.exists():
            return ""
        text = self.log_path.read_text(errors="replace").splitlines()
        return "\n".join(text[-lines:])


class Supervisor:
    def __init__(
        self,
        *,
        cwd: Path,
        env: dict[str, str],
        grace_seconds: float = 8.0,
        out: Callable[[str], None] = print,
    ) -> None:
        self.cwd = cwd
        self.env = env
        self.grace_seconds = grace_seconds
        self.out = out
        self.children: list[Child] = []
        self.stop_requested = False
        self.kill_now = False
        self._previous_handlers: dict[int, object] = {}

    # --- signals --------------------------------------------------------------------------

    def install_signal_handlers(self) -> None:
        for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            self._previous_handlers[signum] = signal.signal(signum, self._on_signal)

    def restore_signal_handlers(self) -> None:
        for signum, handler in self._previous_handlers.items():
            signal.signal(signum, handler)  # type: ignore[arg-type]
        self._previous_handlers.clear()

    def _on_signal(self, signum: int, frame: object) -> None:
        if self.stop_requested:
            # a second Ctrl-C while stopping: do not wait for the grace period
            self.kill_now = True
        self.stop_requested = True

    # --- children -------------------------------------------------------------------------

    def start(self, child: Child) -> Child:
        stdout: IO[bytes] | None = None
        if child.log_path is not None:
            child.log_path.parent.mkdir(parents=True, exist_ok=True)
            stdout = open(child.log_path, "ab")  # noqa: SIM115 (the child keeps its own copy)
        try:
            child.process = subprocess.Popen(
                child.argv,
                cwd=self.cwd,
                env=self.env,
                stdin=subprocess.DEVNULL,
                stdout=stdout,
                stderr=subprocess.STDOUT if stdout is not None else None,
                start_new_session=True,
            )
        finally:
            if stdout is not None:
                stdout.close()
        self.children.append(child)
        return child

    def first_dead(self) -> Child | None:
        for child in self.children:
            if not child.main_alive():
                return child
        return None

    def stop(self) -> None:
        """SIGTERM every main process, wait up to the grace period for each child's whole
        group to exit, then SIGKILL the groups that are left."""
        for child in self.children:
            if child.main_alive():
                with suppress(ProcessLookupError):
                    os.kill(child.pid, signal.SIGTERM)
            elif child.group_alive():
                # its main process is already dead: nobody is left to stop the rest cleanly
                self._kill_group(child)
        deadline = time.monotonic() + self.grace_seconds
        while time.monotonic() < deadline and not self.kill_now:
            if all(child.gone() for child in self.children):
                return
            time.sleep(0.1)
        for child in self.children:
            if not child.gone():
                self.out(f"{child.name} did not stop within {self.grace_seconds:.0f}s: killing it")
                self._kill_group(child)
        for child in self.children:
            if child.process is not None:
                with suppress(subprocess.TimeoutExpired):
                    child.process.wait(timeout=2)

    @staticmethod
    def _kill_group(child: Child) -> None:
        with suppress(ProcessLookupError, PermissionError):
            os.killpg(child.pid, signal.SIGKILL)

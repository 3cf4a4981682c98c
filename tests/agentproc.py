"""An agent as a real process, as a user runs it: ``python -m <module> ...`` from the project
root, with the agent's token (and the sandbox's address) in its environment and no Django
settings — the client and the framework adapters import no Django. Its output is read line
by line. Shared by the remote-agent end-to-end tests (``tests/api``) and the framework
adapters' (``tests/adapters``)."""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import threading
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


class AgentProcess:
    """``python -m <module> <args>`` (or ``python <path>.py <args>``) in its own process
    group (a SIGKILL takes all of it).
    The environment is this process's at construction (a test may set a variable just
    before), plus ``AGENTOPS_TOKEN``, ``SANDBOX_URL`` when given, and ``env``."""

    def __init__(
        self, module: str, *args: str, token: str, sandbox_url: str = "", **env: str
    ) -> None:
        environ = {**os.environ, "AGENTOPS_TOKEN": token, "PYTHONPATH": str(ROOT), **env}
        if sandbox_url:
            environ["SANDBOX_URL"] = sandbox_url
        environ.pop("DJANGO_SETTINGS_MODULE", None)  # the client needs no Django
        command = [module] if module.endswith(".py") else ["-m", module]
        self.proc = subprocess.Popen(
            [sys.executable, *command, *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=environ,
            cwd=ROOT,
            start_new_session=True,
        )
        self.lines: queue.Queue[str] = queue.Queue()
        self.seen: list[str] = []
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.put(line.rstrip("\n"))

    def wait_for(self, prefix: str, timeout: float = 60) -> str:
        """The next line starting with ``prefix`` (``queue.Empty`` after ``timeout`` s of
        silence); the lines before it are kept in ``seen``."""
        while True:
            line = self.lines.get(timeout=timeout)
            self.seen.append(line)
            if line.startswith(prefix):
                return line

    def kill(self) -> None:
        os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=10)

    def finish(self, timeout: float = 90) -> int:
        """Its exit code; killed if it is still running after ``timeout``."""
        try:
            code = self.proc.wait(timeout=timeout)
        finally:
            if self.proc.poll() is None:
                self.kill()
        self.reader.join(timeout=5)
        while not self.lines.empty():
            self.seen.append(self.lines.get())
        return code

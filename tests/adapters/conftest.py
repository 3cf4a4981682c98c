"""Framework agents as real processes against a live server and the sandbox (in its
non-deduplicating mode): each registers the demo refunder's manifest under its own name,
owned by a service account in the agent role."""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from agentops.demo.remote_agent import MANIFEST
from runs.actors import Actor
from runs.remote import agent_manifest_put
from tests.api.conftest import token_for

ROOT = Path(__file__).resolve().parents[2]


class AgentProcess:
    """``python -m <module> <url> <run id>`` with the agent's token; its output, line by line."""

    def __init__(self, module: str, *args: str, token: str, sandbox_url: str, **env: str):
        environ = {
            **os.environ,
            "AGENTOPS_TOKEN": token,
            "SANDBOX_URL": sandbox_url,
            "PYTHONPATH": str(ROOT),
            **env,
        }
        environ.pop("DJANGO_SETTINGS_MODULE", None)  # the adapters need no Django
        self.proc = subprocess.Popen(
            [sys.executable, "-m", module, *args],
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

    def wait_for(self, prefix: str, timeout: float = 30) -> str:
        while True:
            line = self.lines.get(timeout=timeout)
            self.seen.append(line)
            if line.startswith(prefix):
                return line

    def kill(self) -> None:
        os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=10)

    def finish(self, timeout: float = 60) -> int:
        try:
            code = self.proc.wait(timeout=timeout)
        finally:
            if self.proc.poll() is None:
                self.kill()
        self.reader.join(timeout=5)
        while not self.lines.empty():
            self.seen.append(self.lines.get())
        return code


@pytest.fixture
def register_refunder(robot, django_user_model):
    """``register_refunder(name)``: the demo refunder's manifest (a reconcilable refund that
    needs an approval above 100.00) under ``name``; returns a token of its owner."""
    admin = django_user_model.objects.create_superuser("root", password="x")

    def register(name: str) -> str:
        manifest = {**MANIFEST, "owner": robot.username}
        agent_manifest_put(name=name, manifest=manifest, actor=Actor.for_user(admin, "cli"))
        return token_for(robot, name)

    return register

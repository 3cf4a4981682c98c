"""A live MCP gateway (``manage.py runmcp``) and the MCP SDK's own client against it."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from contextlib import suppress
from pathlib import Path
from typing import Any

import anyio
import pytest
from django.conf import settings
from mcp import Client
from mcp.client.streamable_http import streamable_http_client
from mcp.shared._httpx_utils import create_mcp_http_client

from runs.actors import Actor
from runs.tokens import api_token_create
from tests.runs.workerprocs import MANAGE, worker_env

# short holds: a gated call answers "awaiting approval" after this long
HOLD_SECONDS = "3"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class McpProcess:
    """``manage.py runmcp`` in its own process group, against the test database."""

    def __init__(self, log_path: Path, env: dict[str, str]) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}/mcp/"
        self.log_path = log_path
        with open(log_path, "ab") as log:
            self.process = subprocess.Popen(
                [sys.executable, MANAGE, "runmcp", "--port", str(self.port)],
                cwd=settings.BASE_DIR,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self._wait_listening()

    def _wait_listening(self, timeout: float = 30) -> None:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            assert self.process.poll() is None, self.log_path.read_text()
            with suppress(OSError), socket.create_connection(("127.0.0.1", self.port), 0.2):
                return
            time.sleep(0.05)
        raise AssertionError(f"runmcp did not listen:\n{self.log_path.read_text()}")

    def kill(self) -> None:
        with suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait()


@pytest.fixture
def mcp_server(tmp_path, sandbox):
    """Starts MCP gateway processes (``start()``); kills whatever is left at the end."""
    started: list[McpProcess] = []

    class Starter:
        def start(self) -> McpProcess:
            env = worker_env(sandbox, AGENTOPS_MCP_HOLD_SECONDS=HOLD_SECONDS)
            process = McpProcess(tmp_path / "runmcp.log", env)
            started.append(process)
            return process

    yield Starter()
    for process in started:
        process.kill()


@pytest.fixture
def agent_account(django_user_model, roles):
    user = django_user_model.objects.create_user("mcp-robot", password="x")
    from django.contrib.auth.models import Group

    user.groups.add(Group.objects.get(name="agent"))
    return user


def token_of(user: Any, name: str) -> str:
    _, raw = api_token_create(name=name, principal=user, actor=Actor.system("cli"))
    return raw


def run_client(url: str, token: str | None, script: Any) -> Any:
    """Run ``script(client)`` (async) with the MCP SDK's client, over streamable HTTP."""

    async def main() -> Any:
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        async with (
            create_mcp_http_client(headers=headers) as http,
            Client(streamable_http_client(url, http_client=http)) as client,
        ):
            return await script(client)

    return anyio.run(main)

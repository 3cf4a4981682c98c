"""A live MCP gateway (``manage.py runmcp``) and the MCP SDK's own client against it."""

from __future__ import annotations

import json
import socket
import threading
import time
from contextlib import suppress
from pathlib import Path
from typing import Any

import anyio
import pytest
from mcp import Client
from mcp.client.streamable_http import streamable_http_client
from mcp.shared._httpx_utils import create_mcp_http_client

from agentops.workerprocs import WorkerProcess
from runs.actors import Actor
from runs.tokens import api_token_create
from tests.runs.workerprocs import worker_env

# short holds: a gated call answers "awaiting approval" after this long
HOLD_SECONDS = "3"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class McpProcess(WorkerProcess):
    """``manage.py runmcp`` in its own process group, against the test database
    (``agentops.workerprocs``, as for workers)."""

    def __init__(self, log_path: Path, env: dict[str, str]) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}/mcp/"
        super().__init__("runmcp", env, log_path, command=["runmcp", "--port", str(self.port)])
        self._wait_listening()

    def _wait_listening(self, timeout: float = 30) -> None:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            assert self.alive, self.output()
            with suppress(OSError), socket.create_connection(("127.0.0.1", self.port), 0.2):
                return
            time.sleep(0.05)
        raise AssertionError(f"runmcp did not listen:\n{self.output()}")

    def kill(self) -> None:
        self.kill_group()


@pytest.fixture
def mcp_server(tmp_path, sandbox):
    """Starts MCP gateway processes (``start()``); kills whatever is left at the end."""
    started: list[McpProcess] = []

    class Starter:
        def start(self, **env_overrides: str) -> McpProcess:
            env = worker_env(sandbox, AGENTOPS_MCP_HOLD_SECONDS=HOLD_SECONDS, **env_overrides)
            process = McpProcess(tmp_path / f"runmcp.{len(started)}.log", env)
            started.append(process)
            return process

    yield Starter()
    for process in started:
        process.kill()


class UpstreamServer:
    """An MCP server of someone else's tools, in a thread of the test process: ``add_note``
    writes to its own ledger (with the ``_meta`` key it was given), ``broken`` always fails."""

    def __init__(self) -> None:
        import mcp_types as types
        import uvicorn
        from mcp.server.lowlevel import Server

        self.ledger: list[dict[str, Any]] = []

        async def list_tools(ctx, params):
            return types.ListToolsResult(
                tools=[
                    types.Tool(name="add_note", input_schema={"type": "object"}),
                    types.Tool(name="broken", input_schema={"type": "object"}),
                ]
            )

        async def call_tool(ctx, params):
            if params.name == "broken":
                return types.CallToolResult(
                    content=[types.TextContent(type="text", text="disk full")], is_error=True
                )
            meta = params.meta or ctx.meta or {}
            self.ledger.append(
                {"text": (params.arguments or {}).get("text"), "key": meta.get(UPSTREAM_KEY)}
            )
            note = len(self.ledger)
            return types.CallToolResult(
                content=[types.TextContent(type="text", text=f"note {note}")],
                structured_content={"note": note},
            )

        server = Server("upstream", on_list_tools=list_tools, on_call_tool=call_tool)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}/mcp/"
        app = server.streamable_http_app(streamable_http_path="/mcp/")
        self.server = uvicorn.Server(
            uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning")
        )
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        end = time.monotonic() + 10
        while not self.server.started:
            assert time.monotonic() < end, "the upstream MCP server did not start"
            time.sleep(0.02)

    def config(self, **tool: Any) -> dict[str, Any]:
        spec = {"effect": "unsafe", "schema": NOTE_SCHEMA, **tool}
        return {
            "notes": {
                "url": self.url,
                "timeout": 3,
                "tools": {"add_note": spec, "broken": {"effect": "unsafe"}},
            }
        }

    def tools_for_test(self, **tool: Any) -> list[Any]:
        from agentops.mcp.upstream import parse, tools_from

        return tools_from(parse(json.dumps(self.config(**tool))))

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)


UPSTREAM_KEY = "agentops/idempotency_key"
NOTE_SCHEMA = {
    "type": "object",
    "properties": {"text": {"type": "string", "maxLength": 200}},
    "required": ["text"],
    "additionalProperties": False,
}


@pytest.fixture
def upstream():
    started = UpstreamServer()
    yield started
    started.stop()


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


def call(url: str, token: str, name: str, arguments: dict, key: str | None = None) -> Any:
    meta = {"agentops/idempotency_key": key} if key else None

    async def script(client):
        return await client.call_tool(name, arguments, meta=meta)

    return run_client(url, token, script)


def call_until_final(url: str, token: str, name: str, arguments: dict, key: str, timeout=40):
    """What a client does with a "pending" answer: the same call again, same key."""
    end = time.monotonic() + timeout
    while True:
        result = call(url, token, name, arguments, key)
        if result.structured_content["status"] in ("succeeded", "failed"):
            return result
        assert time.monotonic() < end, result.structured_content

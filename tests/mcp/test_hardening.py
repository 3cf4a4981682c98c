"""The gateway under load and probing, in-process: requests with no valid token count against
the API's per-address rate (429 past it, a valid token never refused for them); a process
holding as many ``tools/call`` requests as it may refuses the next one before recording it."""

from __future__ import annotations

from types import SimpleNamespace

import anyio
import httpx
import mcp_types as types
import pytest
from asgiref.sync import sync_to_async
from django.core.cache import caches
from django.db import connections

from agentops.mcp import server, services
from agentops.mcp.models import GatewayCall
from runs.actors import Actor
from runs.models import Run
from runs.throttling import UnauthenticatedRateThrottle
from runs.tokens import api_token_create

# the token lookup runs in the gateway's database thread: it must see the committed token
pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("roles")]


@pytest.fixture
def three_a_minute(settings, monkeypatch):
    settings.CACHES = {"default": {"BACKEND": "django.core.cache.backends.locmem.LocMemCache"}}
    monkeypatch.setattr(UnauthenticatedRateThrottle, "THROTTLE_RATES", {"anon": "3/min"})
    yield
    caches["default"].clear()


async def _inner(scope, receive, send) -> None:
    """Stands for the SDK's app: whatever passed the token check is answered 200."""
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b"{}"})


def _post(address: str, token: str | None = None) -> httpx.Response:
    async def main() -> httpx.Response:
        transport = httpx.ASGITransport(app=server.TokenRequired(_inner), client=(address, 5000))
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1") as http:
            answer = await http.post("/mcp/", json={}, headers=headers)
        # the gateway's database thread closes its connection (the test database is dropped)
        await sync_to_async(connections.close_all, thread_sensitive=True)()
        return answer

    return anyio.run(main)


def test_requests_without_a_valid_token_are_throttled_per_address(three_a_minute, robot):
    _, valid = api_token_create(name="mcp", principal=robot, actor=Actor.system("cli"))
    for token in (None, "ao_not-a-token", None):
        assert _post("198.51.100.7", token).status_code == 401
    refused = _post("198.51.100.7", "ao_another-guess")
    assert refused.status_code == 429
    assert refused.json()["code"] == "throttled" and refused.json()["retry_after"] > 0
    assert int(refused.headers["Retry-After"]) > 0
    # only failures count, and only failures are refused: an agent behind the same address
    assert _post("198.51.100.7", valid).status_code == 200
    # another address has its own count
    assert _post("203.0.113.9").status_code == 401


def test_past_the_process_cap_a_call_is_refused_before_anything_is_recorded(
    robot, settings, monkeypatch
):
    token, _ = api_token_create(name="mcp", principal=robot, actor=Actor.system("cli"))
    settings.AGENTOPS_MCP = {**settings.AGENTOPS_MCP, "MAX_HELD": 2}
    monkeypatch.setattr(server._Held, "count", 2)  # two calls held already
    ctx = SimpleNamespace(
        request=SimpleNamespace(scope={server.TOKEN_SCOPE_KEY: token}, headers={}), meta=None
    )
    params = types.CallToolRequestParams(name="lookup_order", arguments={"order_id": "ord_1004"})

    answer = anyio.run(server.call_tool, ctx, params)

    assert answer.is_error
    body = answer.structured_content
    assert body["code"] == services.GatewayBusy.code == "gateway_busy"
    assert body["retry_after"] == services.GatewayBusy.RETRY_AFTER
    assert not GatewayCall.objects.exists() and not Run.objects.exists()
    assert server._Held.count == 2  # a refused call holds nothing

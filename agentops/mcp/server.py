"""The MCP server (docs/mcp.md): the official SDK's low-level ``Server`` over streamable
HTTP at ``/mcp/``, behind an ``agent``-role bearer token.

``tools/list`` lists the tools the token's principal may use, with their schemas.
``tools/call`` records the call (``gateway_call_record``) and holds the request while the
workers run it, reading the record; after ``AGENTOPS_MCP["HOLD_SECONDS"]`` (at most 55 s) it
answers with a handle instead: awaiting approval, or still in progress. The same call again
(same key) answers its outcome once there is one — it is never dispatched twice.

The handlers are async (the SDK's); every database access goes through ``sync_to_async``
and is short, so a held request holds no connection, lock or thread while it waits.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Mapping
from typing import Any

import mcp_types as types
from asgiref.sync import sync_to_async
from django.conf import settings
from django.db import close_old_connections
from django.http.request import HttpHeaders
from mcp.server.lowlevel import Server
from mcp.server.transport_security import TransportSecuritySettings

from agentops.mcp import selectors, services
from runs.actors import PermissionDenied
from runs.models import ApiToken
from runs.registry import Effect, Tool
from runs.services import InvalidInput, InvalidState
from runs.throttling import UnauthenticatedRateThrottle
from runs.tokens import api_token_authenticate

MCP_PATH = "/mcp/"
TOKEN_SCOPE_KEY = "agentops.token"
# the _meta keys a client may set on tools/call
META_KEY = "agentops/idempotency_key"
META_KEY_PLAIN = "idempotency_key"
META_RUN = "agentops/run_id"
# true: the call goes into a dry run (its tools that are not read only say what they would do)
META_DRY_RUN = "agentops/dry_run"
RUN_HEADER = "x-agentops-run"


def _db(fn: Any) -> Any:
    """Run ``fn`` in Django's thread, with a fresh connection if the old one went stale."""

    def call(*args: Any, **kwargs: Any) -> Any:
        close_old_connections()
        return fn(*args, **kwargs)

    return sync_to_async(call, thread_sensitive=True)


def _token(ctx: Any) -> ApiToken:
    request = ctx.request
    token = request.scope.get(TOKEN_SCOPE_KEY) if request is not None else None
    if token is None:  # the ASGI app refuses such a request before it gets here
        raise PermissionDenied("no token")
    return token


def _meta(ctx: Any, params: Any) -> Mapping[str, Any]:
    meta = getattr(params, "meta", None) or ctx.meta or {}
    if hasattr(meta, "model_dump"):
        meta = meta.model_dump(by_alias=True)
    return meta if isinstance(meta, Mapping) else {}


def _tool_entry(tool: Tool) -> types.Tool:
    return types.Tool(
        name=tool.name,
        description=tool.description or None,
        input_schema=dict(tool.schema),
        annotations=types.ToolAnnotations(
            read_only_hint=tool.effect == Effect.READ,
            idempotent_hint=tool.effect in (Effect.READ, Effect.IDEMPOTENT),
            destructive_hint=tool.effect != Effect.READ,
        ),
    )


async def list_tools(ctx: Any, params: Any) -> types.ListToolsResult:
    token = _token(ctx)
    tools = await _db(services.tools_for)(token.principal)
    return types.ListToolsResult(tools=[_tool_entry(tool) for tool in tools])


def _error(code: str, message: str, **extra: Any) -> types.CallToolResult:
    body = {"status": "error", "code": code, "detail": message, **extra}
    return types.CallToolResult(
        content=[types.TextContent(type="text", text=f"{code}: {message}")],
        structured_content=body,
        is_error=True,
    )


def _answer(outcome: selectors.Outcome) -> types.CallToolResult:
    body = {"status": outcome.status, "agentops": outcome.handle}
    if outcome.status == selectors.SUCCEEDED:
        body["result"] = outcome.result
        text = json.dumps(outcome.result, default=str)
    elif outcome.status == selectors.FAILED:
        body["error"] = outcome.error
        text = f"The call failed: {outcome.error}"
    elif outcome.status == selectors.AWAITING_APPROVAL:
        text = (
            "The call awaits a person's approval; nothing has been done yet. Call the tool "
            "again with the same arguments (or the same idempotency key) to get its outcome "
            "once it is decided. Handle: " + json.dumps(outcome.handle, default=str)
        )
    else:
        text = (
            "The call is recorded and still in progress. Call the tool again with the same "
            "arguments (or the same idempotency key) to get its outcome; it will not be done "
            "twice. Handle: " + json.dumps(outcome.handle, default=str)
        )
    return types.CallToolResult(
        content=[types.TextContent(type="text", text=text)],
        structured_content=json.loads(json.dumps(body, default=str)),
        is_error=outcome.status == selectors.FAILED,
    )


class _Held:
    """The ``tools/call`` requests this process holds now (its event loop's: no lock). Past
    ``AGENTOPS_MCP["MAX_HELD"]`` a new call is refused before anything is recorded
    (``gateway_busy``, with ``retry_after``): each held call is an open connection and a
    poll of the record, and a process must not take more of them than it can serve."""

    count = 0


async def call_tool(ctx: Any, params: types.CallToolRequestParams) -> types.CallToolResult:
    token = _token(ctx)
    if _Held.count >= settings.AGENTOPS_MCP["MAX_HELD"]:
        busy = services.GatewayBusy()
        return _error(busy.code, str(busy), **busy.extra)
    _Held.count += 1
    try:
        return await _record_and_hold(token, ctx, params)
    finally:
        _Held.count -= 1


async def _record_and_hold(
    token: ApiToken, ctx: Any, params: types.CallToolRequestParams
) -> types.CallToolResult:
    meta = _meta(ctx, params)
    client_key = meta.get(META_KEY) or meta.get(META_KEY_PLAIN) or ""
    headers = ctx.request.headers if ctx.request is not None else {}
    run_id = meta.get(META_RUN) or headers.get(RUN_HEADER) or ""
    # the transport's session when it has one; the modern protocol has none: the token
    session = headers.get("mcp-session-id") or f"token:{token.id}"
    try:
        call = await _db(services.gateway_call_record)(
            token=token,
            tool_name=params.name,
            arguments=dict(params.arguments or {}),
            client_key=str(client_key) if client_key else "",
            run_id=str(run_id),
            session=session,
            dry_run=meta.get(META_DRY_RUN) is True,
        )
    except PermissionDenied as exc:
        return _error(getattr(exc, "code", "permission_denied"), str(exc))
    except (InvalidInput, InvalidState) as exc:
        return _error(exc.code, str(exc))
    except services.RunNotFound as exc:
        return _error(exc.code, str(exc))
    hold = settings.AGENTOPS_MCP["HOLD_SECONDS"]
    poll = settings.AGENTOPS_MCP["POLL_SECONDS"]
    give_up_at = time.monotonic() + hold
    while True:
        outcome = await _db(selectors.gateway_call_outcome)(call_id=call.id)
        if outcome.unlinked_tool_call is not None:
            await _db(services.gateway_call_link)(
                call_id=call.id, tool_call_id=outcome.unlinked_tool_call
            )
        if outcome.final or time.monotonic() >= give_up_at:
            return _answer(outcome)
        await asyncio.sleep(poll)


def build_server() -> Server:
    return Server(
        "agentops",
        version="1",
        instructions=(
            "Tool calls go through agentops: each is a durable call of a run, with approvals, "
            "receipts and reconciliation. Set _meta['agentops/idempotency_key'] to make a "
            "retry safe across reconnections; a call awaiting approval answers with a handle: "
            "call again with the same key for its outcome."
        ),
        on_list_tools=list_tools,
        on_call_tool=call_tool,
    )


# --- the ASGI app: the token first --------------------------------------------------------------


def _authenticate(raw: str) -> tuple[ApiToken | None, bool]:
    close_old_connections()
    token = api_token_authenticate(raw) if raw else None
    if token is None:
        return None, False
    try:
        services.gateway_require(token.principal)
    except PermissionDenied:
        return token, False
    return token, True


class _AddressOnly:
    """What DRF's throttle reads of a request (``get_ident``: ``META`` and ``headers``): the
    connection's address and ``X-Forwarded-For``, which counts only when ``NUM_PROXIES``
    says proxies set it."""

    def __init__(self, scope: Any) -> None:
        client = scope.get("client") or ("", 0)
        self.META = {"REMOTE_ADDR": client[0] or ""}
        forwarded = dict(scope.get("headers") or []).get(b"x-forwarded-for")
        if forwarded is not None:
            self.META["HTTP_X_FORWARDED_FOR"] = forwarded.decode("latin-1")
        self.headers = HttpHeaders(self.META)


def _count_unauthenticated(scope: Any) -> float | None:
    """A request with no token or a bad one counts against the API's ``anon`` rate of its
    address (``runs.throttling``: the same count, shared by every process through the
    cache); past the rate, the seconds to wait. A valid token is never counted."""
    throttle = UnauthenticatedRateThrottle()
    if throttle.allow_request(_AddressOnly(scope), None):
        return None
    return throttle.wait() or 1.0


async def _refuse(
    send: Any, status: int, code: str, detail: str, *, retry_after: float | None = None
) -> None:
    fields: dict[str, Any] = {"code": code, "detail": detail}
    headers = []
    if retry_after is not None:
        fields["retry_after"] = round(retry_after, 3)
        headers.append((b"retry-after", str(int(retry_after) + 1).encode()))
    body = json.dumps(fields).encode()
    headers += [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
    ]
    if status == 401:
        headers.append((b"www-authenticate", b'Bearer realm="mcp"'))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


class TokenRequired:
    """Every HTTP request needs a live ``agent``-role API token (``Authorization: Bearer``):
    none or an unknown, expired or revoked one is ``401``; a token of another role ``403``.
    MCP's own OAuth flow is not offered (docs/mcp.md)."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        header = dict(scope.get("headers") or []).get(b"authorization", b"").decode("latin-1")
        scheme, _, raw = header.strip().partition(" ")
        token, allowed = (None, False)
        if scheme.lower() == "bearer" and raw.strip():
            token, allowed = await _db(_authenticate)(raw.strip())
        if token is None:
            wait = await _db(_count_unauthenticated)(scope)
            if wait is not None:
                await _refuse(
                    send,
                    429,
                    "throttled",
                    "Too many requests without a valid token from this address.",
                    retry_after=wait,
                )
                return
            await _refuse(send, 401, "not_authenticated", "Invalid, expired or revoked token.")
            return
        if not allowed:
            await _refuse(
                send, 403, "permission_denied", "The MCP gateway takes agent tokens only."
            )
            return
        scope[TOKEN_SCOPE_KEY] = token
        await self.app(scope, receive, send)


LOOPBACK = ("127.0.0.1", "localhost", "[::1]")


def transport_security() -> TransportSecuritySettings:
    """The SDK's DNS-rebinding check (``Host`` and ``Origin``): loopback, and the host names
    of Django's ``ALLOWED_HOSTS`` — a proxy in front forwards the site's own ``Host``. A
    ``*`` there turns the check off, as it does for the web process."""
    names = [host for host in settings.ALLOWED_HOSTS if host and not host.startswith(".")]
    if "*" in names:
        return TransportSecuritySettings(enable_dns_rebinding_protection=False)
    hosts = [*LOOPBACK, *names]
    return TransportSecuritySettings(
        enable_dns_rebinding_protection=True,
        allowed_hosts=[pattern for host in hosts for pattern in (host, f"{host}:*")],
        allowed_origins=[
            origin
            for host in hosts
            for scheme in ("http", "https")
            for origin in (f"{scheme}://{host}", f"{scheme}://{host}:*")
        ],
    )


def build_app() -> Any:
    server = build_server()
    app = server.streamable_http_app(
        streamable_http_path=MCP_PATH, transport_security=transport_security()
    )
    return TokenRequired(app)

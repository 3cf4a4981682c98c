"""Tools proxied from upstream MCP servers (docs/mcp.md, "Upstream MCP servers").

``AGENTOPS_MCP_UPSTREAMS`` names each upstream server and the tools of it agentops offers,
each with the effect class and approval policy the operator declares for it. They are
registered as ordinary tools (``<upstream>.<tool>``), so an MCP client's call of one goes
through the same record as any call: gate, key, dispatch by a worker, receipt. The worker
calls the upstream tool with the MCP SDK's client, passing the call's idempotency key in
``_meta["agentops/idempotency_key"]``.

Every process (web, workers, the gateway) registers the same tools from the same setting;
nothing is fetched from the upstream at start-up, so its schema is declared here too.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any

from django.core.exceptions import ImproperlyConfigured

from runs.registry import (
    NO_APPROVAL,
    ApprovalPolicy,
    Effect,
    OutcomeUnknown,
    Tool,
    ToolContext,
    ToolFailed,
    ToolResult,
    registry,
)

# an upstream's call cannot be looked up by key: read, idempotent (the upstream honours the
# key it is given) or unsafe (an unknown outcome goes to a person)
EFFECTS = (Effect.READ, Effect.IDEMPOTENT, Effect.UNSAFE)
NAME = re.compile(r"^[A-Za-z0-9_-]{1,40}$")
TOOL_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,58}$")
META_KEY = "agentops/idempotency_key"


def parse(raw: str) -> dict[str, Any]:
    """The setting's JSON, checked: a bad declaration stops the process with its reason."""
    if not raw.strip():
        return {}
    try:
        config = json.loads(raw)
    except ValueError as exc:
        raise ImproperlyConfigured(f"AGENTOPS_MCP_UPSTREAMS is not JSON: {exc}") from None
    if not isinstance(config, dict):
        raise ImproperlyConfigured("AGENTOPS_MCP_UPSTREAMS: an object of upstream servers")
    for name, upstream in config.items():
        where = f"AGENTOPS_MCP_UPSTREAMS[{name!r}]"
        if not NAME.match(name):
            raise ImproperlyConfigured(f"{where}: a name of letters, digits, _ and -")
        if not isinstance(upstream, dict) or not str(upstream.get("url", "")).startswith(
            ("http://", "https://")
        ):
            raise ImproperlyConfigured(f"{where}: needs an http(s) url")
        if not isinstance(upstream.get("headers", {}), dict):
            raise ImproperlyConfigured(f"{where}.headers: an object")
        tools = upstream.get("tools")
        if not isinstance(tools, dict) or not tools:
            raise ImproperlyConfigured(f"{where}.tools: an object of the tools it offers")
        for tool_name, spec in tools.items():
            here = f"{where}.tools[{tool_name!r}]"
            if not TOOL_NAME.match(tool_name) or not isinstance(spec, dict):
                raise ImproperlyConfigured(f"{here}: a tool name and an object")
            if spec.get("effect") not in EFFECTS:
                raise ImproperlyConfigured(
                    f"{here}.effect: one of {', '.join(EFFECTS)} (an upstream call has no "
                    "lookup by key)"
                )
            if spec.get("approval", "never") not in ("never", "always"):
                raise ImproperlyConfigured(f"{here}.approval: never or always")
    return config


def _caller(url: str, headers: Mapping[str, str], upstream_tool: str) -> Any:
    # imported here, when an upstream is configured, not at the call: importing the SDK
    # takes long enough to pass a dispatch's send deadline
    import anyio
    import httpx2
    from mcp import Client
    from mcp.client.streamable_http import streamable_http_client
    from mcp.shared._httpx_utils import create_mcp_http_client

    def call_upstream(arguments: Mapping[str, Any], ctx: ToolContext) -> ToolResult:
        async def call() -> Any:
            timeout = max(ctx.remaining(), 0.001)
            with anyio.fail_after(timeout):
                async with (
                    create_mcp_http_client(
                        headers=dict(headers), timeout=httpx2.Timeout(timeout)
                    ) as http,
                    Client(streamable_http_client(url, http_client=http)) as client,
                ):
                    # the session's set-up has no effect; the call must not leave late
                    ctx.check_send()
                    return await client.call_tool(
                        upstream_tool, dict(arguments), meta={META_KEY: ctx.idempotency_key}
                    )

        ctx.check_send()
        try:
            result = anyio.run(call)
        except OutcomeUnknown:
            raise
        except Exception as exc:
            # a timeout, a reset, a refused or broken session: the upstream may have run it
            raise OutcomeUnknown(
                f"upstream {url} {upstream_tool}: {type(exc).__name__}: {exc}"
            ) from exc
        texts = [getattr(block, "text", "") for block in result.content or ()]
        if result.is_error:
            raise ToolFailed(" ".join(texts)[:500] or f"upstream {upstream_tool} failed")
        if result.structured_content is not None:
            return ToolResult(result=result.structured_content)
        return ToolResult(result={"content": texts})

    return call_upstream


def tools_from(config: Mapping[str, Any]) -> list[Tool]:
    made = []
    for name, upstream in config.items():
        for tool_name, spec in upstream["tools"].items():
            approval = (
                ApprovalPolicy(when="always", group=spec.get("approval_group", "approver"))
                if spec.get("approval") == "always"
                else NO_APPROVAL
            )
            made.append(
                Tool(
                    name=f"{name}.{tool_name}",
                    effect=Effect(spec["effect"]),
                    call=_caller(upstream["url"], upstream.get("headers", {}), tool_name),
                    schema=spec.get("schema", {"type": "object"}),
                    description=spec.get("description", f"{tool_name} of {name} (upstream MCP)"),
                    sensitive_fields=tuple(spec.get("sensitive_fields", ())),
                    approval=approval,
                    allowed_groups=tuple(spec.get("allowed_groups", ())),
                    timeout=float(spec.get("timeout", upstream.get("timeout", 10.0))),
                )
            )
    return made


def register(config: Mapping[str, Any]) -> None:
    for tool in tools_from(config):
        registry.register_tool(tool)

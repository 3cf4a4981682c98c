"""HTTP for tools, within the dispatch's deadlines (DESIGN §9, docs/agents.md).

httpx's ``timeout=5.0`` bounds each phase (connect, write, read) on its own, so a request can
take several times that — and "the landing deadline is the send deadline + the tool's
timeout" would not be a real bound. ``request()`` makes the tool's timeout the bound of the
whole call, connection set-up included: every phase gets only what is left of it, and the
request's first byte is never written after the send deadline (``ToolContext.check_send``),
however long this process was frozen before it. The idempotency key, the fence and the send
deadline travel as headers, for a downstream that checks them.

What remains (documented in docs/architecture.md): a pause that begins after the last check
and before the last byte is written.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from runs.registry import OutcomeUnknown, SendDeadlinePassed, ToolContext, ToolFailed

if TYPE_CHECKING:
    import httpx

# the answer of a downstream that honours deadlines to a request received after its send
# deadline (the sandbox's; a real service may answer its own way: map it in the tool)
LATE_CODE = "send_deadline_passed"

_PHASES = ("connect", "read", "write", "pool")


def request(
    ctx: ToolContext, method: str, url: str, *, raise_for_status: bool = True, **kwargs: Any
) -> httpx.Response:
    """One HTTP request inside the call's budget. Transport trouble and timeouts are unknown
    outcomes (the request may have been applied); with ``raise_for_status`` a 5xx is unknown
    too, a 4xx a definite failure (``ToolFailed``), and a downstream's refusal of a late
    request (409 ``send_deadline_passed``) ``SendDeadlinePassed``."""
    import httpx  # here: a worker that never calls HTTP tools starts faster without it

    ctx.check_send()

    def trace(event: str, info: dict[str, Any]) -> None:
        if not event.endswith(".started"):
            return
        left = ctx.remaining()
        if left <= 0:
            raise httpx.TimeoutException(f"{method} {url}: the call's total timeout passed")
        if event.endswith("send_request_headers.started"):
            # the last moment before the request's first byte leaves
            ctx.check_send()
        if "timeout" in info and event.startswith("connection."):
            info["timeout"] = left if info["timeout"] is None else min(info["timeout"], left)
        outgoing = info.get("request")
        if outgoing is not None:
            outgoing.extensions["timeout"] = dict.fromkeys(_PHASES, left)

    headers = {**ctx.headers(), **kwargs.pop("headers", {})}
    extensions = {**kwargs.pop("extensions", {}), "trace": trace}
    try:
        # a client, not httpx.request(): only Client.request takes ``extensions``
        with httpx.Client(timeout=httpx.Timeout(ctx.remaining())) as client:
            response = client.request(method, url, headers=headers, extensions=extensions, **kwargs)
    except SendDeadlinePassed:
        raise
    except httpx.TimeoutException as exc:
        raise OutcomeUnknown(f"{method} {url} timed out ({ctx.timeout}s in all)") from exc
    except httpx.TransportError as exc:
        raise OutcomeUnknown(f"{method} {url}: {type(exc).__name__}: {exc}") from exc
    if not raise_for_status:
        return response
    if response.status_code == 409 and _code(response) == LATE_CODE:
        raise SendDeadlinePassed(f"{method} {url}: the downstream refused it as received late")
    if response.status_code >= 500:
        raise OutcomeUnknown(f"{method} {url} answered {response.status_code}")
    if response.status_code >= 400:
        raise ToolFailed(f"{method} {url} answered {response.status_code}: {_body(response)}")
    return response


def _body(response: httpx.Response) -> Any:
    try:
        body = response.json()
    except ValueError:
        return response.text[:200]
    return body.get("error", body) if isinstance(body, dict) else body


def _code(response: httpx.Response) -> str:
    try:
        body = response.json()
    except ValueError:
        return ""
    return str(body.get("error", "")) if isinstance(body, dict) else ""

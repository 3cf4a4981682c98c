"""Demo tools that call the sandbox payments service over HTTP.

Each shows one effect class: ``lookup_order`` (read), ``refund_payment`` (reconcilable: the
sandbox may not deduplicate, but it answers a lookup by key) and ``send_notification``
(unsafe: neither, so an unknown outcome always goes to a person).

The calls go through ``runs.toolhttp.request``: the tool's timeout bounds the whole call,
no byte leaves after the dispatch's send deadline, and the idempotency key, the fence and
the send deadline travel as headers. What the sandbox honours depends on how it runs, so
the tools declare it from settings, read when they are built (``AGENTOPS_SANDBOX_HONOURS``:
``key``, ``deadline``, both or nothing; ``AGENTOPS_SANDBOX_RESEND=person``): a declaration
that does not match the sandbox is a configuration error (docs/agents.md).
"""

from __future__ import annotations

from collections.abc import Mapping
from decimal import Decimal
from typing import TYPE_CHECKING, Any

from django.conf import settings

from runs import toolhttp
from runs.registry import (
    ApprovalPolicy,
    Effect,
    LookupResult,
    OutcomeUnknown,
    Reconciliation,
    Tool,
    ToolContext,
    ToolFailed,
    ToolResult,
    money,
)

if TYPE_CHECKING:
    import httpx

REFUND_APPROVAL_THRESHOLD_CENTS = 10_000


def _url(path: str) -> str:
    return settings.AGENTOPS["SANDBOX_URL"].rstrip("/") + path


def _honours(what: str) -> bool:
    return what in settings.AGENTOPS["SANDBOX_HONOURS"]


def _call(ctx: ToolContext, method: str, path: str, **kwargs: Any) -> httpx.Response:
    """A tool's request: within the call's budget and send deadline, with the headers a
    downstream can check (``runs.toolhttp``)."""
    return toolhttp.request(ctx, method, _url(path), **kwargs)


def _request(method: str, path: str, *, timeout: float, **kwargs: Any) -> httpx.Response:
    """A plain bounded request, for the reconcile lookup (no dispatch, no deadline). Maps
    transport trouble onto the engine's outcome classes: a timeout, a reset or a 5xx is an
    unknown outcome (the request may have been applied); a 4xx is a definite no."""
    import httpx  # here: a worker that never calls the sandbox starts faster without it

    try:
        response = httpx.request(method, _url(path), timeout=timeout, **kwargs)
    except httpx.TimeoutException as exc:
        raise OutcomeUnknown(f"{method} {path} timed out after {timeout}s") from exc
    except httpx.TransportError as exc:
        raise OutcomeUnknown(f"{method} {path}: {type(exc).__name__}: {exc}") from exc
    if response.status_code >= 500:
        raise OutcomeUnknown(f"{method} {path} answered {response.status_code}")
    if response.status_code >= 400:
        body = _json(response)
        raise ToolFailed(
            f"{method} {path} answered {response.status_code}: {body.get('error', body)}"
        )
    return response


def _json(response: httpx.Response) -> dict[str, Any]:
    try:
        return response.json()
    except ValueError:
        return {"raw": response.text[:200]}


# --- lookup_order (read) ----------------------------------------------------------------------


def lookup_order(arguments: Mapping[str, Any], ctx: ToolContext) -> ToolResult:
    response = _call(ctx, "GET", f"/orders/{arguments['order_id']}")
    return ToolResult(result=response.json())


LOOKUP_ORDER = Tool(
    name="lookup_order",
    effect=Effect.READ,
    call=lookup_order,
    description="Look up an order in the payments service.",
    schema={
        "type": "object",
        "properties": {"order_id": {"type": "string", "pattern": "^ord_[0-9]+$"}},
        "required": ["order_id"],
        "additionalProperties": False,
    },
    # the order's customer is their email address: masked wherever the run is shown, also
    # where an agent copied it (the refund's and the notification's arguments, the state)
    sensitive_output=("customer",),
    timeout=settings.AGENTOPS["SANDBOX_TIMEOUT"],
)


# --- refund_payment (reconcilable) ----------------------------------------------------------------


def refund_payment(arguments: Mapping[str, Any], ctx: ToolContext) -> ToolResult:
    response = _call(
        ctx,
        "POST",
        "/refunds",
        json={
            "idempotency_key": ctx.idempotency_key,
            "order_id": arguments["order_id"],
            "amount_cents": arguments["amount_cents"],
            "reason": arguments.get("reason", ""),
        },
    )
    body = response.json()
    return ToolResult(result=body, external_ref=body.get("refund_id", ""))


def dry_run_refund(arguments: Mapping[str, Any], ctx: ToolContext) -> ToolResult:
    """What the refund would do, without a request to the payments service (a dry run)."""
    return ToolResult(
        result={
            "dry_run": True,
            # not the summary: it would copy the customer's email (a sensitive argument,
            # masked only in the call's record) into the result
            "would": f"POST /refunds: Refund {money(arguments['amount_cents'], CURRENCY)} "
            f"to order {arguments['order_id']}",
            "order_id": arguments["order_id"],
            "amount_cents": arguments["amount_cents"],
            "idempotency_key": ctx.idempotency_key,
            "refund_id": None,
        }
    )


def reconcile_refund(idempotency_key: str, arguments: Mapping[str, Any]) -> Reconciliation:
    response = _request("GET", "/refunds", timeout=5.0, params={"idempotency_key": idempotency_key})
    body = response.json()
    found = body.get("found")
    if found is True:
        refund = body["refunds"][0]
        return Reconciliation(LookupResult.FOUND, result=refund, external_ref=refund["refund_id"])
    if found is False:
        return Reconciliation(LookupResult.ABSENT)
    return Reconciliation(LookupResult.UNKNOWN, detail=str(body.get("detail", "lookup undecided")))


def _large_refund(arguments: Mapping[str, Any]) -> bool:
    """refunds above 100.00"""
    return int(arguments.get("amount_cents", 0)) > REFUND_APPROVAL_THRESHOLD_CENTS


# the sandbox's orders are in euros
CURRENCY = "EUR"


def _refund_summary(arguments: Mapping[str, Any]) -> str:
    text = f"Refund {money(arguments['amount_cents'], CURRENCY)} to order {arguments['order_id']}"
    if arguments.get("customer_email"):
        text += f" (customer {arguments['customer_email']})"  # masked: "***"
    return text


REFUND_PAYMENT = Tool(
    name="refund_payment",
    effect=Effect.RECONCILABLE,
    call=refund_payment,
    dry_run=dry_run_refund,
    reconcile=reconcile_refund,
    description="Refund (part of) an order. Refunds above 100.00 need an approver.",
    schema={
        "type": "object",
        "properties": {
            "order_id": {"type": "string", "pattern": "^ord_[0-9]+$"},
            "amount_cents": {"type": "integer", "minimum": 1},
            "reason": {"type": "string", "maxLength": 500},
            "customer_email": {"type": "string"},
        },
        "required": ["order_id", "amount_cents"],
        "additionalProperties": False,
    },
    sensitive_fields=("customer_email",),
    summary=_refund_summary,
    money_arguments={"amount_cents": CURRENCY},
    approval=ApprovalPolicy(when=_large_refund, group="approver", ttl_seconds=24 * 3600),
    timeout=settings.AGENTOPS["SANDBOX_TIMEOUT"],
    # the sandbox deduplicates refunds by key with --dedupe, refuses late ones with --deadline
    honours_key=_honours("key"),
    honours_deadline=_honours("deadline"),
    resend=settings.AGENTOPS["SANDBOX_RESEND"],
    # the payment provider's fee per refund: what a spend cap counts for each refund that
    # succeeds (runs.spend; docs/agents.md "Spend caps") — try a principal's daily cap of 0.50
    max_cost=Decimal("0.25"),
)


# --- send_notification (unsafe) --------------------------------------------------------------------


def send_notification(arguments: Mapping[str, Any], ctx: ToolContext) -> ToolResult:
    response = _call(
        ctx,
        "POST",
        "/notifications",
        json={"to": arguments["to"], "subject": arguments["subject"], "body": arguments["body"]},
    )
    body = response.json()
    return ToolResult(result=body, external_ref=body.get("notification_id", ""))


def dry_run_notification(arguments: Mapping[str, Any], ctx: ToolContext) -> ToolResult:
    """What would be sent, without sending it (a dry run). The recipient is a sensitive
    argument: it is not repeated in the result."""
    return ToolResult(
        result={
            "dry_run": True,
            "would": f"POST /notifications: {arguments['subject']!r} to the customer",
            "notification_id": None,
        }
    )


SEND_NOTIFICATION = Tool(
    name="send_notification",
    effect=Effect.UNSAFE,
    call=send_notification,
    dry_run=dry_run_notification,
    description="Send a message to a customer. Cannot be looked up or deduplicated.",
    schema={
        "type": "object",
        "properties": {
            "to": {"type": "string", "minLength": 3},
            "subject": {"type": "string", "minLength": 1, "maxLength": 200},
            "body": {"type": "string", "minLength": 1},
        },
        "required": ["to", "subject", "body"],
        "additionalProperties": False,
    },
    sensitive_fields=("to",),
    timeout=settings.AGENTOPS["SANDBOX_TIMEOUT"],
    # notifications are never deduplicated; with --deadline a late one is refused
    honours_key=False,
    honours_deadline=_honours("deadline"),
)

ALL_TOOLS = (LOOKUP_ORDER, REFUND_PAYMENT, SEND_NOTIFICATION)

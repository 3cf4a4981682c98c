"""Tools whose code holds what could make a fingerprint differ between processes: lambdas, a
set literal (a frozenset constant, ordered by str hashes), closures, partials, a callable
object with state, an object default. ``test_registry`` computes their fingerprints here and in
fresh interpreters with other hash seeds; they must agree."""

from __future__ import annotations

import functools
from typing import Any

from runs.registry import ApprovalPolicy, Effect, LookupResult, Reconciliation, Tool, ToolResult
from tests.support import CountingTool

CURRENCIES = ("EUR", "USD")


class _Marker:
    """An object with a default repr (its address): it counts by its type only."""


_MARKER = _Marker()


def _pay(arguments: Any, ctx: Any, *, marker: Any = _MARKER, currency: str = "EUR") -> ToolResult:
    if arguments.get("kind") in {"refund", "charge", "void", "capture"}:
        return ToolResult({"currency": currency, "ok": currency in CURRENCIES})
    return ToolResult({"ok": False})


def _limited(limit: int):
    seen: list[Any] = []

    def call(arguments: Any, ctx: Any) -> ToolResult:
        seen.append(arguments)
        return ToolResult({"paid": min(arguments.get("amount", 0), limit)})

    return call


TOOLS = (
    Tool(
        name="fp.lambda",
        effect=Effect.RECONCILABLE,
        call=lambda arguments, ctx: ToolResult({"echo": dict(arguments)}),
        reconcile=lambda key, arguments: Reconciliation(LookupResult.ABSENT),
        precondition=lambda arguments: f"v={sorted(arguments)}",
        approval=ApprovalPolicy(when=lambda arguments: arguments.get("amount", 0) > 150),
    ),
    Tool(name="fp.partial", effect=Effect.IDEMPOTENT, call=functools.partial(_pay, currency="USD")),
    Tool(name="fp.closure", effect=Effect.IDEMPOTENT, call=_limited(150)),
    Tool(name="fp.object", effect=Effect.UNSAFE, call=CountingTool(_pay), version="7"),
)

"""Test-only agents and tools, and helpers that read the sandbox and move the record's clock.

Agents and tools made here are registered through the ``register`` fixture (conftest), which
unregisters them after the test.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from datetime import timedelta
from typing import Any

import httpx
from django.db import connection
from django.utils import timezone

from runs.models import Run, RunEvent, ToolCall
from runs.registry import (
    NO_APPROVAL,
    Action,
    Agent,
    ApprovalPolicy,
    DecisionContext,
    Effect,
    Reconciliation,
    Tool,
    ToolContext,
    ToolResult,
)


class WorkerKilled(BaseException):
    """Stands in for SIGKILL: the engine catches ``Exception`` only, so nothing after the
    raise runs and nothing is recorded, exactly as if the process had died there."""


class ScriptedAgent(Agent):
    """An agent whose ``decide`` is a plain function of the context."""

    def __init__(
        self,
        name: str,
        decide: Callable[[DecisionContext], Action],
        *,
        tools: tuple[str, ...] = (),
        version: str = "1",
        input_schema: Mapping[str, Any] | None = None,
    ) -> None:
        self.name = name
        self.version = version
        self.tools = tools
        self.input_schema = input_schema or {"type": "object"}
        self._decide = decide

    def decide(self, ctx: DecisionContext) -> Action:
        return self._decide(ctx)


class CountingTool:
    """A tool body that records every call it receives; ``behaviour`` may raise."""

    def __init__(self, behaviour: Callable[[Mapping[str, Any], ToolContext], Any] | None = None):
        self.calls: list[dict[str, Any]] = []
        self.behaviour = behaviour

    def __call__(self, arguments: Mapping[str, Any], ctx: ToolContext) -> ToolResult:
        self.calls.append({"arguments": dict(arguments), "key": ctx.idempotency_key})
        if self.behaviour is not None:
            outcome = self.behaviour(arguments, ctx)
            if isinstance(outcome, ToolResult):
                return outcome
        return ToolResult(result={"call": len(self.calls)})


def make_tool(
    name: str,
    body: CountingTool,
    *,
    effect: Effect = Effect.READ,
    schema: Mapping[str, Any] | None = None,
    approval: ApprovalPolicy = NO_APPROVAL,
    timeout: float = 1.0,
    reconcile: Callable[[str, Mapping[str, Any]], Reconciliation] | None = None,
) -> Tool:
    # a timeout under LEASE_TTL / 2 keeps the lease-renewal thread out of these tests
    return Tool(
        name=name,
        effect=effect,
        call=body,
        schema=schema or {"type": "object"},
        approval=approval,
        timeout=timeout,
        reconcile=reconcile,
    )


# --- the sandbox's own record -------------------------------------------------------------


def refunds(sandbox) -> list[dict[str, Any]]:
    return httpx.get(f"{sandbox.url}/refunds/all", timeout=5).json()["refunds"]


def refund_posts(sandbox) -> list[dict[str, Any]]:
    """Every POST /refunds the sandbox received (logged before any fault applies)."""
    params = {"path": "/refunds", "method": "POST"}
    return httpx.get(f"{sandbox.url}/requests", params=params, timeout=5).json()["requests"]


def refund_lookups(sandbox) -> list[dict[str, Any]]:
    params = {"path": "/refunds", "method": "GET"}
    return httpx.get(f"{sandbox.url}/requests", params=params, timeout=5).json()["requests"]


def notifications(sandbox) -> list[dict[str, Any]]:
    return httpx.get(f"{sandbox.url}/notifications", timeout=5).json()["notifications"]


def set_faults(sandbox, **counters: int) -> None:
    httpx.post(f"{sandbox.url}/faults", json=counters, timeout=5).raise_for_status()


# --- the record -----------------------------------------------------------------------------


def event_types(run_id: Any) -> list[str]:
    return list(
        RunEvent.objects.filter(run_id=run_id).order_by("seq").values_list("type", flat=True)
    )


def events(run_id: Any, type: str) -> list[RunEvent]:
    return list(RunEvent.objects.filter(run_id=run_id, type=type).order_by("seq"))


def expire_lease(run_id: Any) -> None:
    """The lease holder stopped renewing (paused, partitioned or dead) long enough ago."""
    Run.objects.filter(id=run_id).update(lease_expires_at=timezone.now() - timedelta(seconds=60))


def rewind(run_id: Any, seconds: float = 600) -> None:
    """Move every recorded time of the run's pending work into the past, as if that much
    time had gone by: cheaper and more certain than sleeping through a window."""
    delta = timedelta(seconds=seconds)
    run = Run.objects.get(id=run_id)
    if run.wake_at is not None:
        Run.objects.filter(id=run_id).update(wake_at=run.wake_at - delta)
    for call in ToolCall.objects.filter(run_id=run_id):
        ToolCall.objects.filter(id=call.id).update(
            **{
                name: getattr(call, name) - delta if getattr(call, name) else None
                for name in (
                    "dispatched_at",
                    "send_deadline",
                    "landing_deadline",
                    "lookup_started_at",
                    "next_reconcile_at",
                )
            }
        )


def close_connection() -> None:
    """For threads: each has its own connection, which Django does not close for it."""
    connection.close()

"""toolcall_resolve: an operator's answer to an unknown outcome does what it says, once."""

from __future__ import annotations

import pytest
from django.conf import settings
from django.db import transaction

from runs.actors import Actor, PermissionDenied
from runs.models import Run, Step, ToolCall, ToolReceipt
from runs.registry import (
    CallTool,
    Effect,
    Finish,
    LookupResult,
    OutcomeUnknown,
    Reconciliation,
)
from runs.services import (
    InvalidInput,
    InvalidState,
    UnsafeDispatchUnconfirmed,
    run_create,
    toolcall_resolve,
)
from tests.conftest import drive
from tests.support import (
    CountingTool,
    ScriptedAgent,
    events,
    make_tool,
    refund_posts,
    refunds,
    rewind,
    set_faults,
)

pytestmark = pytest.mark.django_db


@pytest.fixture(autouse=True)
def _windows(monkeypatch):
    monkeypatch.setitem(settings.AGENTOPS, "RECONCILE_MAX_ATTEMPTS", 3)
    monkeypatch.setitem(settings.AGENTOPS, "RECONCILE_BACKOFF", 0.2)
    monkeypatch.setitem(settings.AGENTOPS, "REDISPATCH_MARGIN", 0.5)


def _finish_with_last_step(ctx):
    last = ctx.last_step
    return Finish({"status": last.status, "output": last.output, "error": last.error})


@pytest.fixture
def unsafe(register):
    """An unsafe tool whose first call's outcome is lost; later calls succeed."""
    plan = {"lose": 1}

    def behaviour(arguments, ctx):
        if plan["lose"]:
            plan["lose"] -= 1
            raise OutcomeUnknown("connection reset by peer")

    body = CountingTool(behaviour)

    def decide(ctx):
        if not ctx.steps:
            return CallTool("resolve_unsafe_send", {"to": "c@example.com"})
        return _finish_with_last_step(ctx)

    register(
        make_tool("resolve_unsafe_send", body, effect=Effect.UNSAFE),
        ScriptedAgent("resolve_unsafe", decide, tools=("resolve_unsafe_send",)),
    )
    return body


def _stuck_unsafe_run(system_actor) -> tuple[Run, ToolCall]:
    run = run_create(agent_name="resolve_unsafe", actor=system_actor)
    run = drive(run.id)
    assert (run.status, run.reason_code) == (Run.Status.NEEDS_ATTENTION, "unknown_outcome")
    return run, ToolCall.objects.get(run=run)


@pytest.fixture
def olivia(operator) -> Actor:
    return Actor.for_user(operator, "web")


def test_happened_records_an_operator_receipt_and_the_agent_goes_on(unsafe, system_actor, olivia):
    run, call = _stuck_unsafe_run(system_actor)

    call = toolcall_resolve(
        tool_call_id=call.id,
        outcome="happened",
        actor=olivia,
        external_ref="ntf_42",
        result={"notification_id": "ntf_42"},
    )

    assert call.status == ToolCall.Status.SUCCEEDED
    receipt = call.receipt
    assert (receipt.source, receipt.recorded_by) == (ToolReceipt.Source.OPERATOR, "user:olivia")
    assert receipt.external_ref == "ntf_42"
    step = Step.objects.get(run=run, seq=1)
    assert (step.status, step.output) == (Step.Status.COMPLETED, {"notification_id": "ntf_42"})
    run.refresh_from_db()
    assert (run.status, run.reason_code) == (Run.Status.QUEUED, "")
    (resolved,) = events(run.id, "tool.resolved")
    assert (resolved.actor, resolved.channel) == ("user:olivia", "web")
    assert resolved.payload["outcome"] == "happened"
    assert resolved.payload["by"] == "user:olivia"

    run = drive(run.id)

    assert run.status == Run.Status.SUCCEEDED
    assert run.result["status"] == "completed"
    assert len(unsafe.calls) == 1  # never sent again


def test_not_happened_fails_the_step_and_the_agent_decides_next(unsafe, system_actor, olivia):
    run, call = _stuck_unsafe_run(system_actor)

    call = toolcall_resolve(
        tool_call_id=call.id, outcome="not_happened", actor=olivia, attestation="checked"
    )

    assert call.status == ToolCall.Status.FAILED
    assert call.receipt.source == ToolReceipt.Source.OPERATOR
    run = drive(run.id)
    assert run.status == Run.Status.SUCCEEDED
    assert run.result["status"] == "failed"
    assert "did not happen (resolved by user:olivia)" in run.result["error"]
    assert len(unsafe.calls) == 1


def test_dispatching_an_unsafe_call_again_needs_the_risk_confirmed(unsafe, system_actor, olivia):
    run, call = _stuck_unsafe_run(system_actor)
    events_before = run.event_seq

    with pytest.raises(UnsafeDispatchUnconfirmed) as refused, transaction.atomic():
        toolcall_resolve(tool_call_id=call.id, outcome="dispatch_again", actor=olivia)
    assert refused.value.code == "unsafe_dispatch_unconfirmed"
    run.refresh_from_db()
    assert (run.status, run.event_seq) == (Run.Status.NEEDS_ATTENTION, events_before)

    toolcall_resolve(
        tool_call_id=call.id, outcome="dispatch_again", actor=olivia, confirm_risk=True
    )
    (resolved,) = events(run.id, "tool.resolved")
    assert resolved.payload["confirmed_risk"] is True

    run = drive(run.id)
    # the first request may still land: not sent again before its window has passed
    assert run.status == Run.Status.QUEUED
    assert len(unsafe.calls) == 1
    rewind(run.id)
    run = drive(run.id)

    assert run.status == Run.Status.SUCCEEDED
    assert len(unsafe.calls) == 2
    assert unsafe.calls[0]["key"] == unsafe.calls[1]["key"] == call.idempotency_key
    call.refresh_from_db()
    assert (call.status, call.attempt_count, call.redispatch_authorized) == (
        ToolCall.Status.SUCCEEDED,
        2,
        False,
    )


@pytest.fixture
def undecidable(register):
    """A reconcilable tool whose outcome is lost and whose lookup cannot tell, until it can."""
    plan = {"lookup": LookupResult.UNKNOWN}

    def behaviour(arguments, ctx):
        raise OutcomeUnknown("timed out")

    body = CountingTool(behaviour)
    lookups = []

    def lookup(key, arguments):
        lookups.append(key)
        if plan["lookup"] == LookupResult.FOUND:
            return Reconciliation(LookupResult.FOUND, result={"found": key}, external_ref="x1")
        return Reconciliation(plan["lookup"], detail="the ledger is down")

    register(
        make_tool("resolve_transfer", body, effect=Effect.RECONCILABLE, reconcile=lookup),
        ScriptedAgent(
            "resolve_transferer",
            lambda ctx: (
                CallTool("resolve_transfer", {}) if not ctx.steps else _finish_with_last_step(ctx)
            ),
            tools=("resolve_transfer",),
        ),
    )
    return body, plan, lookups


def _drive_to_attention(run_id) -> Run:
    for _ in range(5):
        run = drive(run_id)
        if run.status == Run.Status.NEEDS_ATTENTION:
            return run
        rewind(run_id)
    raise AssertionError(f"run is {run.status}")


def test_reconcile_again_looks_the_key_up_afresh(undecidable, system_actor, olivia):
    body, plan, lookups = undecidable
    run = run_create(agent_name="resolve_transferer", actor=system_actor)
    run = _drive_to_attention(run.id)
    assert len(lookups) == 3
    call = ToolCall.objects.get(run=run)

    plan["lookup"] = LookupResult.FOUND
    call = toolcall_resolve(tool_call_id=call.id, outcome="reconcile", actor=olivia)
    assert call.reconcile_attempts == 0
    run = drive(run.id)

    assert run.status == Run.Status.SUCCEEDED
    assert len(lookups) == 4
    assert len(body.calls) == 1
    call.refresh_from_db()
    assert call.receipt.source == ToolReceipt.Source.RECONCILIATION


def test_resolving_is_refused_unless_an_unknown_call_waits_for_a_person(
    unsafe, system_actor, olivia, viewer
):
    run, call = _stuck_unsafe_run(system_actor)

    with pytest.raises(PermissionDenied), transaction.atomic():
        toolcall_resolve(
            tool_call_id=call.id, outcome="happened", actor=Actor.for_user(viewer, "web")
        )
    with pytest.raises(InvalidInput), transaction.atomic():
        toolcall_resolve(tool_call_id=call.id, outcome="maybe", actor=olivia)
    with pytest.raises(InvalidState, match="no lookup"), transaction.atomic():
        toolcall_resolve(tool_call_id=call.id, outcome="reconcile", actor=olivia)

    toolcall_resolve(tool_call_id=call.id, outcome="happened", actor=olivia)
    with pytest.raises(InvalidState) as again, transaction.atomic():
        toolcall_resolve(tool_call_id=call.id, outcome="not_happened", actor=olivia)
    assert again.value.code == "invalid_state"
    assert len(events(run.id, "tool.resolved")) == 1


def test_refund_dispatched_again_by_an_operator_is_applied_exactly_once(
    sandbox, system_actor, olivia
):
    # the refund is not applied (503) and the lookup cannot tell, three times
    set_faults(sandbox, error_next=1, lookup_unknown_next=3)
    run = run_create(
        agent_name="refund",
        input={"order_id": "ord_1001", "amount_cents": 500},
        actor=system_actor,
    )
    run = _drive_to_attention(run.id)
    assert run.reason_code == Run.Reason.UNKNOWN_OUTCOME
    call = ToolCall.objects.get(run=run, tool_name="refund_payment")

    toolcall_resolve(tool_call_id=call.id, outcome="dispatch_again", actor=olivia)
    rewind(run.id)
    run = drive(run.id)

    assert run.status == Run.Status.SUCCEEDED
    posts = refund_posts(sandbox)
    assert [p["idempotency_key"] for p in posts] == [call.idempotency_key] * 2
    (refund,) = refunds(sandbox)
    assert run.result == {"refunded": True, "refund_id": refund["refund_id"]}


# --- marking failed needs proof of absence or an attestation (issue 21 item 4) ---------------


def test_not_happened_without_a_proving_lookup_needs_an_attestation_that_is_recorded(
    unsafe, system_actor, olivia
):
    from runs.services import AttestationRequired

    run, call = _stuck_unsafe_run(system_actor)  # unsafe: no lookup can ever prove absence

    refused = pytest.raises(AttestationRequired, match="no lookup that started after")
    with refused, transaction.atomic():
        toolcall_resolve(tool_call_id=call.id, outcome="not_happened", actor=olivia)
    assert ToolCall.objects.get(id=call.id).status == ToolCall.Status.UNKNOWN

    toolcall_resolve(
        tool_call_id=call.id,
        outcome="not_happened",
        actor=olivia,
        attestation="  the provider's  log shows no message ",
    )
    [resolved] = events(run.id, "tool.resolved")
    assert resolved.payload["attestation"] == "the provider's log shows no message"
    assert resolved.payload["absence_proven"] is False
    assert resolved.actor == "user:olivia"


def test_absence_is_proven_only_by_an_absent_lookup_that_started_after_the_landing_deadline():
    from datetime import UTC, datetime, timedelta

    from runs.selectors import toolcall_absence_proven

    deadline = datetime(2026, 1, 1, 12, 0, tzinfo=UTC)
    call = ToolCall(landing_deadline=deadline)

    def lookup(outcome: str, started: datetime) -> dict:
        return {"outcome": outcome, "started_at": started.isoformat()}

    after, before = deadline + timedelta(seconds=1), deadline - timedelta(seconds=1)
    assert toolcall_absence_proven(call=call, latest_lookup=lookup("absent", after))
    assert not toolcall_absence_proven(call=call, latest_lookup=lookup("absent", before))
    assert not toolcall_absence_proven(call=call, latest_lookup=lookup("unknown", after))
    assert not toolcall_absence_proven(call=call, latest_lookup=None)
    # a call dispatched without deadlines: nothing proves when it could still land
    undated = ToolCall(landing_deadline=None)
    assert not toolcall_absence_proven(call=undated, latest_lookup=lookup("absent", after))

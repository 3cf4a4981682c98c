"""Unknown outcomes (DESIGN §5.3) against the real sandbox payments service in its
non-deduplicating mode, where only the engine's discipline prevents a double refund."""

from __future__ import annotations

import dataclasses
from datetime import timedelta

import pytest
from django.conf import settings
from django.utils import timezone

from agentops.demo import tools as demo_tools
from agentops.demo.sandbox import FAULT_HEADER
from agentops.demo.tools import REFUND_PAYMENT, SEND_NOTIFICATION
from runs import engine
from runs.models import Run, ToolCall, ToolReceipt
from runs.registry import CallTool, Effect, Finish, OutcomeUnknown, ToolResult
from runs.services import run_create
from tests.conftest import drive
from tests.support import (
    CountingTool,
    ScriptedAgent,
    WorkerKilled,
    event_types,
    events,
    expire_lease,
    make_tool,
    notifications,
    refund_lookups,
    refund_posts,
    refunds,
    rewind,
    set_faults,
)


@pytest.fixture(autouse=True)
def _windows(monkeypatch):
    """Pin the reconciliation settings these tests reason about."""
    monkeypatch.setitem(settings.AGENTOPS, "RECONCILE_MAX_ATTEMPTS", 3)
    monkeypatch.setitem(settings.AGENTOPS, "RECONCILE_BACKOFF", 0.2)
    monkeypatch.setitem(settings.AGENTOPS, "REDISPATCH_MARGIN", 0.5)


def _refund_run(system_actor) -> Run:
    return run_create(
        agent_name="refund",
        input={"order_id": "ord_1001", "amount_cents": 500},
        actor=system_actor,
    )


def _refund_call(run: Run) -> ToolCall:
    return ToolCall.objects.get(run=run, tool_name="refund_payment")


@pytest.mark.django_db
def test_dropped_response_is_reconciled_as_found_with_one_refund(sandbox, system_actor):
    set_faults(sandbox, drop_next=1)  # the sandbox applies the refund, then drops the response
    run = _refund_run(system_actor)

    run = drive(run.id)

    assert run.status == Run.Status.SUCCEEDED
    (refund,) = refunds(sandbox)
    assert len(refund_posts(sandbox)) == 1
    assert run.result == {"refunded": True, "refund_id": refund["refund_id"]}
    call = _refund_call(run)
    assert call.status == ToolCall.Status.SUCCEEDED
    assert call.attempt_count == 1
    assert call.receipt.source == ToolReceipt.Source.RECONCILIATION
    assert call.receipt.external_ref == refund["refund_id"]
    types = event_types(run.id)
    assert types.index("tool.unknown") < types.index("tool.reconcile_attempted")
    assert events(run.id, "tool.reconcile_attempted")[0].payload["outcome"] == "found"


@pytest.mark.django_db
def test_failed_request_is_redispatched_with_the_same_key_only_after_it_can_no_longer_land(
    sandbox, system_actor
):
    set_faults(sandbox, error_next=1)  # 503 without applying
    run = _refund_run(system_actor)

    run = drive(run.id)

    # unknown -> lookup says absent -> parked until the original request can no longer land
    call = _refund_call(run)
    assert call.status == ToolCall.Status.UNKNOWN
    assert run.status == Run.Status.QUEUED
    assert run.wake_at is not None
    # DESIGN §9: the landing deadline, computed by the dispatch in database time
    send_window = settings.AGENTOPS["SEND_WINDOW"]
    assert (call.send_deadline - call.dispatched_at).total_seconds() == pytest.approx(send_window)
    tool_window = send_window + REFUND_PAYMENT.timeout + settings.AGENTOPS["REDISPATCH_MARGIN"]
    assert (call.landing_deadline - call.dispatched_at).total_seconds() == pytest.approx(
        tool_window
    )
    assert run.wake_at == call.landing_deadline
    assert run.wake_at > timezone.now()
    assert len(refund_posts(sandbox)) == 1
    assert refunds(sandbox) == []
    (absent,) = events(run.id, "tool.reconcile_attempted")
    assert absent.payload["outcome"] == "absent"
    assert absent.payload["redispatch_after"] is not None
    assert engine.advance(run.id, worker="w2") == "not_claimed"  # wake_at holds it

    # woken early (a sweeper, an operator): still inside the window, so still no re-dispatch
    Run.objects.filter(id=run.id).update(wake_at=timezone.now() - timedelta(seconds=1))
    run = drive(run.id)
    assert run.status == Run.Status.QUEUED
    assert run.wake_at > timezone.now()
    assert len(refund_posts(sandbox)) == 1

    rewind(run.id)  # the window has passed
    run = drive(run.id)

    assert run.status == Run.Status.SUCCEEDED
    posts = refund_posts(sandbox)
    assert [p["idempotency_key"] for p in posts] == [call.idempotency_key] * 2
    assert [p["applied"] for p in posts] == [False, True]
    (refund,) = refunds(sandbox)
    assert refund["idempotency_key"] == call.idempotency_key
    call.refresh_from_db()
    assert (call.status, call.attempt_count) == (ToolCall.Status.SUCCEEDED, 2)
    assert call.receipt.source == ToolReceipt.Source.TOOL


@pytest.mark.django_db
@pytest.mark.parametrize(
    ("write_fault", "lookup_fault", "refunds_applied"),
    [
        ("drop_next", "lookup_error_next", 1),  # applied, and the lookup errors
        ("error_next", "lookup_unknown_next", 0),  # not applied, and the lookup can't tell
    ],
    ids=["lookup_error", "lookup_unknown"],
)
def test_undecided_lookup_is_never_taken_as_absence(
    sandbox, system_actor, write_fault, lookup_fault, refunds_applied
):
    set_faults(sandbox, **{write_fault: 1, lookup_fault: 3})
    run = _refund_run(system_actor)

    retry_delays = []
    for _ in range(2):
        run = drive(run.id)
        assert run.status == Run.Status.QUEUED  # parked, backing off
        assert run.wake_at > timezone.now()
        retry_delays.append(events(run.id, "tool.reconcile_attempted")[-1].payload)
        # far past both the backoff and the re-dispatch window: were an undecided lookup
        # taken as absence, the refund would now be sent again
        rewind(run.id)
    run = drive(run.id)

    assert run.status == Run.Status.NEEDS_ATTENTION
    assert run.reason_code == Run.Reason.UNKNOWN_OUTCOME
    assert len(refund_posts(sandbox)) == 1  # never sent again
    assert len(refunds(sandbox)) == refunds_applied
    assert len(refund_lookups(sandbox)) == 3
    attempts = events(run.id, "tool.reconcile_attempted")
    assert [e.payload["outcome"] for e in attempts] == ["unknown"] * 3
    assert [e.payload["attempt"] for e in attempts] == [1, 2, 3]
    assert [p["retry_in_seconds"] for p in retry_delays] == [0.2, 0.4]  # backing off
    call = _refund_call(run)
    assert (call.status, call.reconcile_attempts) == (ToolCall.Status.UNKNOWN, 3)
    assert not ToolReceipt.objects.filter(tool_call=call).exists()
    assert engine.advance(run.id, worker="w2") == "not_claimed"  # it waits for a person


# --- a call left in dispatching by an earlier incarnation --------------------------------------


@pytest.mark.django_db
def test_refund_left_dispatching_after_the_effect_is_found_on_the_next_claim(
    sandbox, system_actor, monkeypatch
):
    real_call = REFUND_PAYMENT.call

    def refund_then_die(arguments, ctx):
        real_call(arguments, ctx)
        raise WorkerKilled  # the refund applied; the process died before recording it

    monkeypatch.setattr(REFUND_PAYMENT, "call", refund_then_die)
    run = _refund_run(system_actor)
    with pytest.raises(WorkerKilled):
        engine.advance(run.id, worker="w1")
    monkeypatch.setattr(REFUND_PAYMENT, "call", real_call)
    assert _refund_call(run).status == ToolCall.Status.DISPATCHING

    expire_lease(run.id)
    run = drive(run.id, worker="w2")

    assert run.status == Run.Status.SUCCEEDED
    assert len(refunds(sandbox)) == 1
    assert len(refund_posts(sandbox)) == 1
    call = _refund_call(run)
    assert call.receipt.source == ToolReceipt.Source.RECONCILIATION
    (unknown,) = events(run.id, "tool.unknown")
    assert "left in dispatching by incarnation 1" in unknown.payload["error"]
    assert unknown.incarnation == 2
    assert events(run.id, "run.claimed")[-1].payload["recovered"] is True


@pytest.mark.django_db
def test_refund_left_dispatching_before_the_effect_is_sent_once_after_the_window(
    sandbox, system_actor, monkeypatch
):
    real_call = REFUND_PAYMENT.call

    def die_before_sending(arguments, ctx):
        raise WorkerKilled

    monkeypatch.setattr(REFUND_PAYMENT, "call", die_before_sending)
    run = _refund_run(system_actor)
    with pytest.raises(WorkerKilled):
        engine.advance(run.id, worker="w1")
    monkeypatch.setattr(REFUND_PAYMENT, "call", real_call)

    expire_lease(run.id)
    run = drive(run.id, worker="w2")
    assert run.status == Run.Status.QUEUED  # absent, but it might still land: wait
    assert refund_posts(sandbox) == []

    rewind(run.id)
    run = drive(run.id, worker="w2")

    assert run.status == Run.Status.SUCCEEDED
    (post,) = refund_posts(sandbox)
    assert post["idempotency_key"] == _refund_call(run).idempotency_key
    assert len(refunds(sandbox)) == 1


# --- unsafe tools: an unknown outcome always goes to a person ----------------------------------


def _followup_run(system_actor) -> Run:
    return run_create(
        agent_name="followup",
        input={"order_id": "ord_1002", "message": "Your refund is on its way."},
        actor=system_actor,
    )


@pytest.mark.django_db
def test_unsafe_notification_with_lost_response_goes_to_a_person_and_is_never_resent(
    sandbox, system_actor, monkeypatch, django_user_model
):
    def send_and_lose_response(arguments, ctx):
        response = demo_tools._request(
            "POST",
            "/notifications",
            timeout=ctx.timeout,
            json=dict(arguments),
            headers={FAULT_HEADER: "drop"},  # sent, then the connection drops
        )
        return ToolResult(result=response.json())

    monkeypatch.setattr(SEND_NOTIFICATION, "call", send_and_lose_response)
    run = _followup_run(system_actor)

    run = drive(run.id)
    assert engine.advance(run.id, worker="w2") == "not_claimed"

    assert run.status == Run.Status.NEEDS_ATTENTION
    assert run.reason_code == Run.Reason.UNKNOWN_OUTCOME
    assert "unsafe" in run.reason_detail
    assert len(notifications(sandbox)) == 1
    call = ToolCall.objects.get(run=run, tool_name="send_notification")
    assert (call.status, call.attempt_count) == (ToolCall.Status.UNKNOWN, 1)
    assert events(run.id, "tool.reconcile_attempted") == []

    # the operator checked the customer's inbox: it was sent, with no id to give
    from runs.actors import Actor
    from runs.services import toolcall_resolve

    operator = django_user_model.objects.create_superuser("ops", password="x")
    toolcall_resolve(
        tool_call_id=call.id, outcome="happened", actor=Actor.for_user(operator, "web")
    )
    run = drive(run.id)
    assert run.status == Run.Status.SUCCEEDED
    assert run.result == {"notified": True, "notification_id": None}
    assert len(notifications(sandbox)) == 1


@pytest.fixture
def unsafe_agent(register):
    body = CountingTool()
    plan = {"raise": OutcomeUnknown("connection reset by peer")}

    def behaviour(arguments, ctx):
        raise plan["raise"]

    body.behaviour = behaviour

    def decide(ctx):
        if not ctx.steps:
            return CallTool("test_unsafe_send", {})
        return Finish({"sent": ctx.last_step.status})

    register(
        make_tool("test_unsafe_send", body, effect=Effect.UNSAFE),
        ScriptedAgent("unsafe_sender", decide, tools=("test_unsafe_send",)),
    )
    return body, plan


@pytest.mark.django_db
def test_unsafe_tool_outcome_unknown_needs_attention_immediately(unsafe_agent, system_actor):
    body, _ = unsafe_agent
    run = run_create(agent_name="unsafe_sender", actor=system_actor)

    run = drive(run.id)
    rewind(run.id)
    run = drive(run.id)

    assert (run.status, run.reason_code) == (Run.Status.NEEDS_ATTENTION, "unknown_outcome")
    assert len(body.calls) == 1
    assert "connection reset by peer" in run.reason_detail


@pytest.mark.django_db
def test_unsafe_tool_left_dispatching_is_not_resent_on_recovery(unsafe_agent, system_actor):
    body, plan = unsafe_agent
    plan["raise"] = WorkerKilled()
    run = run_create(agent_name="unsafe_sender", actor=system_actor)
    with pytest.raises(WorkerKilled):
        engine.advance(run.id, worker="w1")

    expire_lease(run.id)
    run = drive(run.id, worker="w2")

    assert (run.status, run.reason_code) == (Run.Status.NEEDS_ATTENTION, "unknown_outcome")
    assert len(body.calls) == 1
    call = ToolCall.objects.get(run=run)
    assert call.status == ToolCall.Status.UNKNOWN


@pytest.mark.django_db
def test_read_tool_outcome_unknown_is_simply_called_again(register, system_actor):
    flaky = {"left": 1}

    def behaviour(arguments, ctx):
        if flaky["left"]:
            flaky["left"] -= 1
            raise OutcomeUnknown("read timed out")

    body = CountingTool(behaviour)

    def decide(ctx):
        if not ctx.steps:
            return CallTool("flaky_read", {})
        return Finish({"status": ctx.last_step.status})

    register(
        make_tool("flaky_read", body),
        ScriptedAgent("flaky_reader", decide, tools=("flaky_read",)),
    )
    run = run_create(agent_name="flaky_reader", actor=system_actor)

    run = drive(run.id)

    assert run.status == Run.Status.SUCCEEDED
    assert run.result == {"status": "completed"}
    assert len(body.calls) == 2
    assert ToolCall.objects.get(run=run).attempt_count == 2


@pytest.mark.django_db
def test_an_unsafe_tool_is_never_repeated_even_when_it_declares_a_deduplicating_downstream(
    register, system_actor
):
    """One rule for who settles an unknown outcome (hosted and remote alike,
    ``engine.unknown_needs_person``): ``unsafe`` goes to a person whatever it declares."""
    body = CountingTool()

    def behaviour(arguments, ctx):
        raise OutcomeUnknown("connection reset by peer")

    body.behaviour = behaviour
    tool = dataclasses.replace(
        make_tool("test_unsafe_keyed", body, effect=Effect.UNSAFE), honours_key=True
    )

    def decide(ctx):
        if not ctx.steps:
            return CallTool("test_unsafe_keyed", {})
        return Finish({"sent": ctx.last_step.status})

    register(tool, ScriptedAgent("unsafe_keyed", decide, tools=("test_unsafe_keyed",)))
    run = drive(run_create(agent_name="unsafe_keyed", actor=system_actor).id)

    assert (run.status, run.reason_code) == (Run.Status.NEEDS_ATTENTION, "unknown_outcome")
    assert len(body.calls) == 1

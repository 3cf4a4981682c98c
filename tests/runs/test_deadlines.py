"""Deadlines guard the world (DESIGN §9): a request never leaves after its dispatch's send
deadline or once its lease was taken over, and a call is re-sent only after a lookup that
started after the original request could no longer land."""

from __future__ import annotations

import time
from datetime import timedelta

import pytest
from django.conf import settings
from django.utils import timezone

from runs import engine
from runs.actors import Actor
from runs.engine import toolcalls
from runs.models import Run, ToolCall
from runs.registry import (
    CallTool,
    Effect,
    Finish,
    LookupResult,
    OutcomeUnknown,
    Reconciliation,
    Resend,
    Tool,
)
from runs.services import run_create, toolcall_resolve
from tests.conftest import drive
from tests.support import CountingTool, ScriptedAgent, events, rewind

pytestmark = pytest.mark.django_db


@pytest.fixture(autouse=True)
def _windows(monkeypatch):
    monkeypatch.setitem(settings.AGENTOPS, "RECONCILE_MAX_ATTEMPTS", 3)
    monkeypatch.setitem(settings.AGENTOPS, "RECONCILE_BACKOFF", 0.2)
    monkeypatch.setitem(settings.AGENTOPS, "REDISPATCH_MARGIN", 0.5)


class Ledger:
    """The downstream's own record: what it applied, by key; ``lose`` answers lost."""

    def __init__(self) -> None:
        self.applied: list[str] = []
        self.lose = 0
        self.lookups = 0
        self.lookup_delay = 0.0

    def call(self, arguments, ctx):
        self.applied.append(ctx.idempotency_key)
        if self.lose:
            self.lose -= 1
            raise OutcomeUnknown("the answer was lost")

    def reconcile(self, key, arguments):
        self.lookups += 1
        found = key in self.applied
        # a lookup that straddles the landing deadline: it looked before, answers after
        time.sleep(self.lookup_delay)
        return Reconciliation(LookupResult.FOUND if found else LookupResult.ABSENT)


def _register_refund(register, ledger: Ledger, *, resend: Resend = Resend.AUTO, name="dl"):
    body = CountingTool(ledger.call)

    def decide(ctx):
        if not ctx.steps:
            return CallTool(f"{name}_refund", {"amount": 1})
        return Finish({"status": ctx.last_step.status})

    register(
        Tool(
            name=f"{name}_refund",
            effect=Effect.RECONCILABLE,
            call=body,
            reconcile=ledger.reconcile,
            timeout=0.5,
            resend=resend,
        ),
        ScriptedAgent(name, decide, tools=(f"{name}_refund",)),
    )
    return body


def test_the_dispatch_computes_its_deadlines_in_database_time(register, system_actor):
    ledger = Ledger()
    _register_refund(register, ledger)
    before = timezone.now()
    run = drive(run_create(agent_name="dl", actor=system_actor).id)

    assert run.status == Run.Status.SUCCEEDED
    call = ToolCall.objects.get(run=run)
    window = min(settings.AGENTOPS["SEND_WINDOW"], settings.AGENTOPS["LEASE_TTL"])
    assert call.dispatched_at >= before - timedelta(seconds=1)
    assert (call.send_deadline - call.dispatched_at).total_seconds() == pytest.approx(window)
    assert (call.landing_deadline - call.send_deadline).total_seconds() == pytest.approx(
        0.5 + settings.AGENTOPS["REDISPATCH_MARGIN"]
    )
    assert ledger.applied == [call.idempotency_key]


@pytest.mark.django_db(transaction=True)  # a refused write ends its own transaction
def test_a_worker_whose_lease_was_taken_over_before_it_sent_never_sends(
    register, system_actor, monkeypatch
):
    """The issue's scenario 1 inside one process: worker A commits dispatching and freezes;
    its lease expires, B claims the run. When A wakes, its pre-send check is refused: the
    downstream never sees A's request, and A writes nothing."""
    ledger = Ledger()
    body = _register_refund(register, ledger)
    run = run_create(agent_name="dl", actor=system_actor)
    real_check = toolcalls._presend_check
    taken_over = {}

    def frozen_then_check(lease, call, tool):
        if not taken_over:
            # A is frozen here; meanwhile its lease expires and B claims the run
            Run.objects.filter(id=run.id).update(
                lease_expires_at=timezone.now() - timedelta(seconds=60)
            )
            taken_over["claim"] = engine.claim(run.id, worker="worker-b")
            assert taken_over["claim"] is not None
        return real_check(lease, call, tool)

    monkeypatch.setattr(toolcalls, "_presend_check", frozen_then_check)
    assert engine.advance(run.id, worker="worker-a") == "lease_lost"

    assert body.calls == []  # A's request never left
    call = ToolCall.objects.get(run=run)
    assert call.status == ToolCall.Status.DISPATCHING  # A wrote nothing after its dispatch
    assert call.dispatch_incarnation == 1
    run.refresh_from_db()
    assert (run.fence, run.lease_owner) == (2, "worker-b")


def test_a_request_past_its_send_deadline_is_not_sent_and_reconciled(
    register, system_actor, monkeypatch
):
    ledger = Ledger()
    body = _register_refund(register, ledger)
    run = run_create(agent_name="dl", actor=system_actor)
    real_check = toolcalls._presend_check
    late = {}

    def paused_past_the_deadline(lease, call, tool):
        if not late:
            late["once"] = True
            # the worker froze longer than its send window (its lease is still its own)
            ToolCall.objects.filter(id=call.id).update(
                send_deadline=timezone.now() - timedelta(seconds=1)
            )
        return real_check(lease, call, tool)

    monkeypatch.setattr(toolcalls, "_presend_check", paused_past_the_deadline)
    run = drive(run.id)

    call = ToolCall.objects.get(run=run)
    assert body.calls == []
    assert call.status == ToolCall.Status.UNKNOWN
    assert "not sent" in call.last_error
    # reconciled like any unknown outcome: absent, but only re-sent after a later lookup
    (absent,) = events(run.id, "tool.reconcile_attempted")
    assert absent.payload["outcome"] == "absent"
    assert absent.payload["redispatch_after"] is not None
    rewind(run.id)
    run = drive(run.id)
    assert run.status == Run.Status.SUCCEEDED
    assert ledger.applied == [call.idempotency_key]


def test_an_absent_from_a_lookup_that_straddles_the_landing_deadline_is_not_a_resend(
    register, system_actor
):
    """The lookup began before the original request could no longer land and answered
    after: it proves nothing about a request landing meanwhile, so the engine looks again
    once the deadline has passed before sending."""
    ledger = Ledger()
    body = _register_refund(register, ledger)
    # the request fails before applying (a reset): absent is the truth here
    body.behaviour = lambda arguments, ctx: (_ for _ in ()).throw(OutcomeUnknown("reset"))
    run = run_create(agent_name="dl", actor=system_actor)
    run = drive(run.id)
    call = ToolCall.objects.get(run=run)
    assert call.status == ToolCall.Status.UNKNOWN
    assert len(body.calls) == 1
    # the lookup starts just before the landing deadline and answers after it
    rewind(run.id)
    ToolCall.objects.filter(id=call.id).update(
        landing_deadline=timezone.now() + timedelta(seconds=0.3)
    )
    Run.objects.filter(id=run.id).update(wake_at=None)
    ledger.lookup_delay = 0.6
    body.behaviour = None
    run = drive(run.id, max_slices=1)
    call.refresh_from_db()
    assert len(body.calls) == 1, "an absent from a straddling lookup re-sent the call"
    straddling = events(run.id, "tool.reconcile_attempted")[-1]
    assert straddling.payload["outcome"] == "absent"
    assert straddling.payload["redispatch_after"] is not None
    assert run.wake_at == call.landing_deadline

    ledger.lookup_delay = 0.0
    time.sleep(max(0.0, (call.landing_deadline - timezone.now()).total_seconds()) + 0.05)
    run = drive(run.id)
    assert run.status == Run.Status.SUCCEEDED
    assert len(body.calls) == 2
    last = events(run.id, "tool.reconcile_attempted")[-1]
    assert last.payload["started_at"] >= call.landing_deadline.isoformat()


def test_resend_person_hands_an_absent_outcome_to_an_operator_who_may_send_it(
    register, system_actor, operator
):
    ledger = Ledger()
    body = _register_refund(register, ledger, resend=Resend.PERSON)
    body.behaviour = lambda arguments, ctx: (_ for _ in ()).throw(OutcomeUnknown("reset"))
    run = drive(run_create(agent_name="dl", actor=system_actor).id)
    rewind(run.id)
    run = drive(run.id)

    assert (run.status, run.reason_code) == (Run.Status.NEEDS_ATTENTION, "unknown_outcome")
    assert "resend: person" in run.reason_detail
    assert len(body.calls) == 1
    call = ToolCall.objects.get(run=run)

    body.behaviour = None
    toolcall_resolve(
        tool_call_id=call.id, outcome="dispatch_again", actor=Actor.for_user(operator, "web")
    )
    run = drive(run.id)
    # the operator's "dispatch again" still looks the key up first, after the deadline
    assert run.status == Run.Status.SUCCEEDED
    assert len(body.calls) == 2
    assert events(run.id, "tool.reconcile_attempted")[-1].payload["outcome"] == "absent"


def test_an_operators_dispatch_again_records_what_a_fresh_lookup_finds_instead_of_sending(
    register, system_actor, operator, monkeypatch
):
    monkeypatch.setitem(settings.AGENTOPS, "RECONCILE_MAX_ATTEMPTS", 1)
    ledger = Ledger()
    ledger.lose = 1
    body = _register_refund(register, ledger)
    lookups = {"n": 0}
    real_reconcile = ledger.reconcile

    def undecided_then_real(key, arguments):
        lookups["n"] += 1
        if lookups["n"] == 1:
            return Reconciliation(LookupResult.UNKNOWN, detail="the lookup is down")
        return real_reconcile(key, arguments)

    register_tool = Tool(
        name="dl3_refund",
        effect=Effect.RECONCILABLE,
        call=body,
        reconcile=undecided_then_real,
        timeout=0.5,
    )
    register(
        register_tool,
        ScriptedAgent(
            "dl3",
            lambda ctx: (
                CallTool("dl3_refund", {"amount": 1})
                if not ctx.steps
                else Finish({"status": ctx.last_step.status})
            ),
            tools=("dl3_refund",),
        ),
    )
    run = drive(run_create(agent_name="dl3", actor=system_actor).id)
    assert (run.status, run.reason_code) == (Run.Status.NEEDS_ATTENTION, "unknown_outcome")
    call = ToolCall.objects.get(run=run)
    assert len(body.calls) == 1  # applied, its answer lost

    toolcall_resolve(
        tool_call_id=call.id, outcome="dispatch_again", actor=Actor.for_user(operator, "web")
    )
    rewind(run.id)
    run = drive(run.id)

    assert run.status == Run.Status.SUCCEEDED
    assert len(body.calls) == 1, "dispatch again re-sent a call a lookup would have found"
    call.refresh_from_db()
    assert call.receipt.source == "reconciliation"

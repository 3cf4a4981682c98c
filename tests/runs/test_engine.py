"""The engine driving runs: fencing against zombies, duplicate wake-ups, budgets, the hot
path's query count, and agents that misbehave."""

from __future__ import annotations

import threading
from datetime import timedelta

import pytest
from django.utils import timezone

from agentops.demo.tools import REFUND_PAYMENT
from runs import engine, tasks
from runs.models import Run, RunEvent, Step, ToolCall, ToolReceipt
from runs.registry import CallTool, Finish, registry
from runs.services import run_create
from tests.conftest import drive
from tests.support import (
    CountingTool,
    ScriptedAgent,
    WorkerKilled,
    close_connection,
    event_types,
    events,
    expire_lease,
    make_tool,
    refund_posts,
    refunds,
)


def _small_refund(system_actor, **extra) -> Run:
    return run_create(
        agent_name="refund",
        input={"order_id": "ord_1001", "amount_cents": 500},
        actor=system_actor,
        **extra,
    )


def _steal_lease(run_id, worker: str = "w2") -> None:
    """Another worker finds the lease expired and claims the run."""
    expire_lease(run_id)
    assert engine.claim(run_id, worker=worker) is not None


# --- zombies --------------------------------------------------------------------------------


@pytest.mark.django_db(transaction=True)
def test_zombie_stops_before_its_side_effect(sandbox, system_actor, monkeypatch):
    run = _small_refund(system_actor)
    agent = registry.agent("refund")
    original = type(agent).decide

    def decide_slowly(ctx):
        if ctx.steps:
            # the worker stalls in the model call past its lease; another one takes over
            _steal_lease(ctx.run_id)
        return original(agent, ctx)

    monkeypatch.setattr(agent, "decide", decide_slowly)

    assert engine.advance(run.id, worker="w1") == "lease_lost"

    assert refund_posts(sandbox) == []
    assert refunds(sandbox) == []
    run.refresh_from_db()
    assert (run.fence, run.lease_owner) == (2, "w2")
    assert list(Step.objects.filter(run=run).values_list("seq", flat=True)) == [1]
    # nothing written by incarnation 1 after incarnation 2 claimed
    takeover = events(run.id, "run.claimed")[-1]
    assert not RunEvent.objects.filter(run=run, incarnation=1, seq__gt=takeover.seq).exists()


@pytest.mark.django_db(transaction=True)
def test_zombie_cannot_record_a_receipt_and_the_new_holder_reconciles_it(
    sandbox, system_actor, monkeypatch
):
    run = _small_refund(system_actor)
    real_call = REFUND_PAYMENT.call

    def refund_then_stall(arguments, ctx):
        result = real_call(arguments, ctx)
        # the refund happened; the worker stalls before recording it and loses the lease
        _steal_lease(ctx.run_id)
        return result

    monkeypatch.setattr(REFUND_PAYMENT, "call", refund_then_stall)
    assert engine.advance(run.id, worker="w1") == "lease_lost"
    monkeypatch.setattr(REFUND_PAYMENT, "call", real_call)

    call = ToolCall.objects.get(run=run, tool_name="refund_payment")
    assert call.status == ToolCall.Status.DISPATCHING
    assert not ToolReceipt.objects.filter(tool_call=call).exists()

    expire_lease(run.id)  # w2 died too; the next worker recovers the run
    run = drive(run.id)

    assert run.status == Run.Status.SUCCEEDED
    assert len(refunds(sandbox)) == 1
    assert len(refund_posts(sandbox)) == 1
    call.refresh_from_db()
    assert call.status == ToolCall.Status.SUCCEEDED
    assert call.receipt.source == ToolReceipt.Source.RECONCILIATION
    assert call.receipt.external_ref == refunds(sandbox)[0]["refund_id"]


# --- duplicate wake-ups (django-q2 delivers at least once) -------------------------------------


@pytest.mark.django_db
def test_duplicate_task_after_the_run_finished_does_nothing(sandbox, system_actor):
    run = _small_refund(system_actor)

    assert tasks.advance_run(str(run.id)) == "parked"
    events_after_first = RunEvent.objects.filter(run=run).count()
    assert tasks.advance_run(str(run.id)) == "not_claimed"

    run.refresh_from_db()
    assert run.status == Run.Status.SUCCEEDED
    assert len(refunds(sandbox)) == 1
    assert RunEvent.objects.filter(run=run).count() == events_after_first
    assert len(events(run.id, "run.claimed")) == 1


@pytest.mark.django_db
def test_duplicate_task_finds_lease_taken(sandbox, system_actor):
    run = _small_refund(system_actor)
    assert engine.claim(run.id, worker="w1") is not None
    events_before = RunEvent.objects.filter(run=run).count()

    assert tasks.advance_run(str(run.id)) == "not_claimed"

    run.refresh_from_db()
    assert (run.fence, run.lease_owner) == (1, "w1")
    assert RunEvent.objects.filter(run=run).count() == events_before
    assert refund_posts(sandbox) == []


@pytest.mark.django_db(transaction=True)
def test_concurrent_duplicate_tasks_give_one_set_of_side_effects(sandbox, system_actor):
    runs = [_small_refund(system_actor) for _ in range(3)]
    for run in runs:
        barrier = threading.Barrier(2)
        results: list[str] = []

        def deliver(run_id=run.id, barrier=barrier, results=results) -> None:
            try:
                barrier.wait(timeout=5)
                results.append(tasks.advance_run(str(run_id)))
            finally:
                close_connection()

        threads = [threading.Thread(target=deliver) for _ in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=60)
        assert sorted(results) == ["not_claimed", "parked"]

    for run in runs:
        run.refresh_from_db()
        assert run.status == Run.Status.SUCCEEDED
        assert len(events(run.id, "run.claimed")) == 1
    posted_keys = sorted(r["idempotency_key"] for r in refund_posts(sandbox))
    assert posted_keys == sorted(f"{run.id}:2" for run in runs)
    assert len(refunds(sandbox)) == 3


# --- budgets ----------------------------------------------------------------------------------


@pytest.fixture
def looping(register):
    """An agent that reads forever: only a budget stops it. ``crash_on`` makes the decision
    with that (1-based) number kill the worker, once."""
    body = CountingTool()
    plan = {"crash_on": None, "decisions": 0}

    def decide(ctx):
        plan["decisions"] += 1
        if plan["decisions"] == plan["crash_on"]:
            plan["crash_on"] = None
            raise WorkerKilled
        return CallTool("loop_read", {})

    register(make_tool("loop_read", body), ScriptedAgent("looper", decide, tools=("loop_read",)))
    return body, plan


def _assert_budget_exhausted(run: Run) -> None:
    assert run.status == Run.Status.NEEDS_ATTENTION
    assert run.reason_code == Run.Reason.BUDGET_EXHAUSTED
    assert run.lease_owner == ""
    (event,) = events(run.id, "run.needs_attention")
    assert event.payload["reason"] == Run.Reason.BUDGET_EXHAUSTED


@pytest.mark.django_db
def test_step_budget_stops_the_run(looping, system_actor):
    body, _ = looping
    run = run_create(agent_name="looper", actor=system_actor, max_steps=3)

    run = drive(run.id)

    _assert_budget_exhausted(run)
    assert run.steps_used == 3
    assert len(body.calls) == 3
    assert "3 of 3 steps" in run.reason_detail


@pytest.mark.django_db
def test_restart_does_not_reset_the_step_budget(looping, system_actor):
    body, plan = looping
    plan["crash_on"] = 3  # two steps done, then the worker dies mid-decision
    run = run_create(agent_name="looper", actor=system_actor, max_steps=4)

    with pytest.raises(WorkerKilled):
        engine.advance(run.id, worker="w1")
    run.refresh_from_db()
    assert (run.status, run.steps_used) == (Run.Status.RUNNING, 2)

    expire_lease(run.id)
    run = drive(run.id, worker="w2")

    _assert_budget_exhausted(run)
    assert run.steps_used == 4
    assert len(body.calls) == 4  # not 2 + 4: the restart kept the usage
    assert [e.payload["recovered"] for e in events(run.id, "run.claimed")] == [False, True]


@pytest.mark.django_db
def test_past_deadline_stops_the_run_before_any_step(looping, system_actor):
    body, _ = looping
    run = run_create(
        agent_name="looper",
        actor=system_actor,
        deadline=timezone.now() - timedelta(minutes=1),
    )

    run = drive(run.id)

    _assert_budget_exhausted(run)
    assert "deadline" in run.reason_detail
    assert body.calls == []
    assert run.steps_used == 0


@pytest.mark.django_db
def test_exhausted_run_is_not_claimed_again(looping, system_actor):
    body, _ = looping
    run = run_create(agent_name="looper", actor=system_actor, max_steps=1)
    drive(run.id)

    assert engine.advance(run.id, worker="w2") == "not_claimed"
    assert len(body.calls) == 1


# --- the hot path's query count ---------------------------------------------------------------

# Measured: 11 queries for one read-tool step on both databases (decided + dispatching in
# one commit, receipt + step_completed in another; each locks the run, inserts, and ends
# with one conditional UPDATE of the run). One query of slack; an extra commit per step,
# or anything that grows with the run's history, fails here.
READ_STEP_MAX_QUERIES = 12
# claim (observe, compare-and-set, load run and steps, database time, run.claimed) and
# finishing, independent of the number of steps: measured 14
SLICE_OVERHEAD_MAX_QUERIES = 16


@pytest.fixture
def reader(register):
    body = CountingTool()

    def decide(ctx):
        if len(ctx.steps) < ctx.input["reads"]:
            return CallTool("hot_read", {"n": len(ctx.steps)})
        return Finish({"reads": len(ctx.steps)})

    register(make_tool("hot_read", body), ScriptedAgent("reader", decide, tools=("hot_read",)))
    return body


@pytest.mark.django_db
def test_one_read_step_stays_within_its_query_budget(
    reader, system_actor, django_assert_max_num_queries
):
    run = run_create(agent_name="reader", input={"reads": 3}, actor=system_actor)
    lease = engine.claim(run.id, worker="w1")
    engine.advance_once(lease)  # a step with history behind it, not the first

    with django_assert_max_num_queries(READ_STEP_MAX_QUERIES) as captured:
        assert engine.advance_once(lease) == engine.Outcome.CONTINUE

    print(f"\nqueries for one read-tool step: {len(captured)}")
    assert len(reader.calls) == 2
    assert Step.objects.get(run=run, seq=2).status == Step.Status.COMPLETED


@pytest.mark.django_db
def test_slice_queries_grow_by_one_step_budget_per_step(
    reader, system_actor, django_assert_max_num_queries
):
    reads = 10
    run = run_create(agent_name="reader", input={"reads": reads}, actor=system_actor)

    bound = SLICE_OVERHEAD_MAX_QUERIES + reads * READ_STEP_MAX_QUERIES
    with django_assert_max_num_queries(bound) as captured:
        assert engine.advance(run.id, worker="w1") == "parked"

    print(f"\nqueries for a slice of {reads} read steps and a finish: {len(captured)}")
    run.refresh_from_db()
    assert run.status == Run.Status.SUCCEEDED
    assert run.result == {"reads": reads}


# --- agents that misbehave ------------------------------------------------------------------


@pytest.mark.django_db
def test_decide_raising_fails_the_run_with_the_error(register, system_actor):
    def decide(ctx):
        raise ValueError("the model answered with something that is not an action")

    register(ScriptedAgent("crashy", decide))
    run = run_create(agent_name="crashy", actor=system_actor)

    run = drive(run.id)

    assert run.status == Run.Status.FAILED
    assert run.reason_code == Run.Reason.AGENT_FAILED
    assert "ValueError: the model answered with something" in run.reason_detail
    (failed,) = events(run.id, "run.failed")
    assert failed.payload["reason"] == Run.Reason.AGENT_FAILED
    assert "ValueError" in failed.payload["detail"]
    assert run.lease_owner == ""


@pytest.mark.django_db
def test_decide_returning_a_non_action_fails_the_run(register, system_actor):
    register(ScriptedAgent("confused", lambda ctx: "refund everything"))
    run = run_create(agent_name="confused", actor=system_actor)

    run = drive(run.id)

    assert (run.status, run.reason_code) == (Run.Status.FAILED, Run.Reason.AGENT_FAILED)
    assert "str" in run.reason_detail


@pytest.fixture
def wayward(register):
    """Makes the call its input asks for once, then finishes with what it saw."""
    body = CountingTool()
    schema = {
        "type": "object",
        "properties": {"n": {"type": "integer"}},
        "required": ["n"],
        "additionalProperties": False,
    }

    def decide(ctx):
        if not ctx.steps:
            return CallTool(ctx.input["tool"], ctx.input["arguments"])
        last = ctx.last_step
        return Finish({"status": last.status, "error": last.error})

    register(
        make_tool("typed_read", body, schema=schema),
        make_tool("retired_read", CountingTool()),
        ScriptedAgent("wayward", decide, tools=("typed_read", "retired_read")),
    )
    registry.unregister_tool("retired_read")  # retired after the agent was registered
    return body


@pytest.mark.django_db
@pytest.mark.parametrize(
    ("tool", "arguments", "error"),
    [
        ("refund_payment", {"order_id": "ord_1001", "amount_cents": 1}, "may not use tool"),
        ("typed_read", {"n": "seven"}, "arguments do not match the schema: n: 'seven'"),
        ("typed_read", {}, "arguments do not match the schema: (root): 'n' is a required"),
        ("retired_read", {}, "unknown tool 'retired_read'"),
    ],
    ids=["tool_not_allowed", "wrong_type", "missing_field", "tool_not_registered"],
)
def test_refused_call_is_a_failed_step_the_agent_sees(
    wayward, sandbox, system_actor, tool, arguments, error
):
    run = run_create(
        agent_name="wayward", input={"tool": tool, "arguments": arguments}, actor=system_actor
    )

    run = drive(run.id)

    step = Step.objects.get(run=run, seq=1)
    assert step.status == Step.Status.FAILED
    assert error in step.error
    assert not ToolCall.objects.filter(run=run).exists()  # nothing was ever dispatched
    assert wayward.calls == []
    assert refund_posts(sandbox) == []
    # the agent saw the refusal and decided on from it
    assert run.status == Run.Status.SUCCEEDED
    assert run.result == {"status": "failed", "error": step.error}
    assert "step.decided" in event_types(run.id)
    assert events(run.id, "step.decided")[0].payload["refused"] == step.error


# --- resume checks ----------------------------------------------------------------------------


@pytest.mark.django_db
def test_run_recovered_too_often_needs_attention(looping, system_actor, settings):
    body, _ = looping
    run = run_create(agent_name="looper", actor=system_actor)
    limit = settings.AGENTOPS["MAX_RECOVERIES"]
    engine.claim(run.id, worker="w1")
    Run.objects.filter(id=run.id).update(recovery_count=limit)
    expire_lease(run.id)

    run = drive(run.id, worker="w2")

    assert (run.status, run.reason_code) == (Run.Status.NEEDS_ATTENTION, "recovery_limit")
    assert run.recovery_count == limit + 1
    assert body.calls == []


@pytest.mark.django_db
def test_run_started_on_another_agent_version_is_not_driven(looping, system_actor):
    body, _ = looping
    run = run_create(agent_name="looper", actor=system_actor)
    Run.objects.filter(id=run.id).update(agent_version="0")

    run = drive(run.id)

    assert run.status == Run.Status.NEEDS_ATTENTION
    assert run.reason_code == Run.Reason.INCOMPATIBLE_AGENT_VERSION
    assert body.calls == []


@pytest.mark.django_db
@pytest.mark.parametrize(
    ("code", "reason_code", "detail"),
    [
        ("agent_failed", "agent_failed", "gave up"),
        ("approval_rejected", "approval_rejected", "gave up"),
        ("approval_expired", "approval_expired", "gave up"),
        ("budget_exhausted", "agent_failed", "gave up (unknown reason code 'budget_exhausted')"),
    ],
)
def test_an_agent_ends_its_run_with_a_reason_code_it_may_give(
    register, system_actor, code, reason_code, detail
):
    from runs.registry import Fail

    register(ScriptedAgent("quitter", lambda ctx: Fail("gave up", code=code)))

    run = drive(run_create(agent_name="quitter", actor=system_actor).id)

    assert (run.status, run.reason_code, run.reason_detail) == (
        Run.Status.FAILED,
        reason_code,
        detail,
    )

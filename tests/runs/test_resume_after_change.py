"""Resume after change (DESIGN §5.2): on every claim, before anything new is decided, a
changed agent, tool, principal or world is noticed and handled, never run through."""

from __future__ import annotations

import pytest
from django.contrib.auth.models import Group
from django.db import transaction

from agentops.demo.tools import REFUND_PAYMENT
from approvals.models import Approval
from approvals.services import approval_decide
from runs import engine
from runs.actors import Actor
from runs.models import Run, Step, ToolCall, ToolReceipt
from runs.registry import (
    ApprovalPolicy,
    CallTool,
    Effect,
    Finish,
    OutcomeUnknown,
    Tool,
    ToolResult,
    WaitForSignal,
    registry,
)
from runs.services import (
    InvalidInput,
    InvalidState,
    run_create,
    run_fork,
    run_resume,
    run_retry_recovery,
    run_terminate,
    toolcall_resolve,
)
from runs.timeline import describe
from tests.conftest import drive
from tests.support import (
    CountingTool,
    ScriptedAgent,
    WorkerKilled,
    event_types,
    events,
    expire_lease,
    make_tool,
    refund_posts,
    refunds,
)

pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("roles")]

ALWAYS = ApprovalPolicy(when="always", group="approver")


@pytest.fixture
def olivia(operator) -> Actor:
    return Actor.for_user(operator, "web")


# --- agent version --------------------------------------------------------------------------


def _counter(version: str, migrations=()) -> ScriptedAgent:
    """Finishes with the state it sees: what the migrations made of it."""
    agent = ScriptedAgent("versioned", lambda ctx: Finish(dict(ctx.state)), version=version)
    agent.migrations = migrations
    return agent


def test_a_registered_migration_path_upgrades_the_state_and_is_recorded(register, system_actor):
    register(_counter("1"))
    run = run_create(agent_name="versioned", actor=system_actor)
    Run.objects.filter(id=run.id).update(state={"count": 2})
    registry.register_agent(
        _counter(
            "3",
            migrations=[
                ("2", "3", lambda s: {"total": s["count"] * 10}),
                ("1", "2", lambda s: {**s, "count": s["count"] + 1}),
            ],
        )
    )

    run = drive(run.id)

    assert run.status == Run.Status.SUCCEEDED
    assert run.agent_version == "3"
    assert run.result == {"total": 30}
    migrated = events(run.id, "run.migrated")
    assert [(e.payload["from"], e.payload["to"]) for e in migrated] == [("1", "2"), ("2", "3")]
    types = event_types(run.id)
    assert types.index("run.migrated") < types.index("step.decided")


def test_without_a_migration_path_the_run_waits_and_can_be_forked_onto_the_new_version(
    register, system_actor, olivia
):
    body = CountingTool()

    def decide(ctx):
        if len(ctx.steps) < 2:
            return CallTool("versioned_read", {"n": len(ctx.steps)})
        return Finish({"reads": [s.output["call"] for s in ctx.steps], "state": ctx.state})

    old = ScriptedAgent("forkable", decide, tools=("versioned_read",), version="1")
    register(make_tool("versioned_read", body), old)
    run = run_create(agent_name="forkable", actor=system_actor, max_steps=10)
    lease = engine.claim(run.id, worker="w1")
    engine.advance_once(lease)  # step 1 done under version 1
    engine.release(lease)

    new = ScriptedAgent("forkable", decide, tools=("versioned_read",), version="2")
    new.apply = lambda state, step: {**state, "seen": state.get("seen", 0) + 1}
    registry.register_agent(new)
    run = drive(run.id)

    assert (run.status, run.reason_code) == (
        Run.Status.NEEDS_ATTENTION,
        "incompatible_agent_version",
    )
    assert "fork" in run.reason_detail
    assert len(body.calls) == 1

    fork = run_fork(run_id=run.id, actor=olivia, from_step=1)

    run.refresh_from_db()
    assert run.status == Run.Status.TERMINATED
    assert (fork.forked_from_id, fork.forked_from_step) == (run.id, 1)
    assert (fork.root_run_id, fork.agent_version) == (run.id, "2")
    assert fork.steps_used == run.steps_used == 1  # usage carried, not reset
    assert fork.state == {"seen": 1}  # rebuilt by today's agent from the carried step
    assert events(run.id, "run.forked")[0].payload["to_run"] == str(fork.id)
    assert events(fork.id, "run.forked")[0].payload["from_run"] == str(run.id)

    fork = drive(fork.id)

    assert fork.status == Run.Status.SUCCEEDED
    assert fork.result == {"reads": [1, 2], "state": {"seen": 2}}
    assert len(body.calls) == 2  # step 1 was carried, not repeated
    assert fork.steps_used == 3


def test_a_failing_migration_leaves_the_run_for_a_person(register, system_actor):
    register(_counter("1"))
    run = run_create(agent_name="versioned", actor=system_actor)

    def broken(state):
        raise KeyError("total")

    registry.register_agent(_counter("2", migrations=[("1", "2", broken)]))
    run = drive(run.id)

    assert (run.status, run.reason_code) == (
        Run.Status.NEEDS_ATTENTION,
        "incompatible_agent_version",
    )
    assert "KeyError" in run.reason_detail
    assert run.agent_version == "1"
    assert events(run.id, "run.migrated") == []


# --- fork: the family's keys name the same effects ---------------------------------------------


def _refund_run(system_actor) -> Run:
    return run_create(
        agent_name="refund",
        input={"order_id": "ord_1001", "amount_cents": 500},
        actor=system_actor,
    )


def test_fork_carries_receipts_and_repeats_no_refund(sandbox, system_actor, olivia):
    run = drive(_refund_run(system_actor).id)
    assert run.status == Run.Status.SUCCEEDED

    fork = drive(run_fork(run_id=run.id, actor=olivia, from_step=1).id)

    assert fork.status == Run.Status.SUCCEEDED
    assert len(refund_posts(sandbox)) == 1
    (refund,) = refunds(sandbox)
    assert fork.result == {"refunded": True, "refund_id": refund["refund_id"]}
    original = ToolCall.objects.get(run=run, tool_name="refund_payment")
    again = ToolCall.objects.get(run=fork, tool_name="refund_payment")
    assert again.idempotency_key == original.idempotency_key == f"{run.id}:2"
    assert again.attempt_count == 0  # adopted from the family's receipt, never dispatched
    assert again.receipt.external_ref == refund["refund_id"]
    carried = ToolCall.objects.get(run=fork, tool_name="lookup_order")
    assert carried.receipt.source == ToolReceipt.Source.TOOL
    assert fork.steps_used == run.steps_used + 2  # the original's 3, and the fork's 2 and 3


def test_fork_after_a_refund_of_unknown_outcome_reconciles_it_by_key(
    sandbox, system_actor, olivia, monkeypatch
):
    real_call = REFUND_PAYMENT.call

    def refund_then_die(arguments, ctx):
        real_call(arguments, ctx)
        raise WorkerKilled

    monkeypatch.setattr(REFUND_PAYMENT, "call", refund_then_die)
    run = _refund_run(system_actor)
    with pytest.raises(WorkerKilled):
        engine.advance(run.id, worker="w1")
    monkeypatch.setattr(REFUND_PAYMENT, "call", real_call)
    expire_lease(run.id)
    run_terminate(run_id=run.id, actor=olivia, reason="moving to a fork")

    fork = drive(run_fork(run_id=run.id, actor=olivia, from_step=1).id)

    assert fork.status == Run.Status.SUCCEEDED
    assert len(refund_posts(sandbox)) == 1
    assert len(refunds(sandbox)) == 1
    call = ToolCall.objects.get(run=fork, tool_name="refund_payment")
    assert call.receipt.source == ToolReceipt.Source.RECONCILIATION
    assert "tool.unknown" in event_types(fork.id)


def test_fork_refuses_an_unfinished_step(sandbox, system_actor, olivia, monkeypatch):
    monkeypatch.setattr(REFUND_PAYMENT, "call", lambda a, c: (_ for _ in ()).throw(WorkerKilled))
    run = _refund_run(system_actor)
    with pytest.raises(WorkerKilled):
        engine.advance(run.id, worker="w1")
    expire_lease(run.id)

    with pytest.raises(InvalidInput, match="not finished"), transaction.atomic():
        run_fork(run_id=run.id, actor=olivia, from_step=2)


def test_a_fork_that_decides_differently_gets_its_own_key(register, system_actor, olivia):
    body = CountingTool()
    plan = {"n": 1}

    def decide(ctx):
        if len(ctx.steps) < 2:
            return CallTool("divergent_write", {"n": plan["n"] * len(ctx.steps)})
        return Finish()

    register(
        make_tool("divergent_write", body, effect=Effect.IDEMPOTENT),
        ScriptedAgent("divergent", decide, tools=("divergent_write",)),
    )
    run = drive(run_create(agent_name="divergent", actor=system_actor).id)
    plan["n"] = 7

    fork = drive(run_fork(run_id=run.id, actor=olivia, from_step=1).id)

    assert fork.status == Run.Status.SUCCEEDED
    assert [c["key"] for c in body.calls] == [f"{run.id}:1", f"{run.id}:2", f"{fork.id}:2"]


# --- tools ---------------------------------------------------------------------------------


@pytest.fixture
def gated(register):
    body = CountingTool()

    def decide(ctx):
        if not ctx.steps:
            return CallTool("gated_write", {"amount": 5})
        last = ctx.last_step
        return Finish({"status": last.status, "error": last.error})

    tool = make_tool(
        "gated_write",
        body,
        effect=Effect.IDEMPOTENT,
        approval=ALWAYS,
        schema={"type": "object", "properties": {"amount": {"type": "integer"}}},
    )
    register(tool, ScriptedAgent("gated", decide, tools=("gated_write",)))
    return body, tool


def _approve(run: Run, approver) -> None:
    approval = Approval.objects.get(run=run, status=Approval.Status.PENDING)
    approval_decide(
        approval_id=approval.id, decision="approve", actor=Actor.for_user(approver, "web")
    )


def test_an_approval_for_an_old_tool_version_is_cancelled_and_requested_again(
    gated, system_actor, approver
):
    body, tool = gated
    run = drive(run_create(agent_name="gated", actor=system_actor).id)
    _approve(run, approver)
    old_version = tool.version

    changed = make_tool(
        "gated_write",
        body,
        effect=Effect.IDEMPOTENT,
        approval=ALWAYS,
        schema={"type": "object", "properties": {"amount": {"type": "number"}}},
    )
    registry.register_tool(changed)
    run = drive(run.id)

    assert run.status == Run.Status.WAITING_APPROVAL
    assert body.calls == []
    old, new = Approval.objects.filter(run=run).order_by("requested_at", "id")
    assert (old.status, old.consumed_at, old.tool_version) == ("cancelled", None, old_version)
    assert (new.status, new.tool_version) == ("pending", changed.version)
    (changed_event,) = events(run.id, "tool.version_changed")
    assert changed_event.payload["to_version"] == changed.version

    _approve(run, approver)
    run = drive(run.id)
    assert run.status == Run.Status.SUCCEEDED
    assert len(body.calls) == 1


def test_a_retired_tool_fails_its_step_and_the_agent_goes_on(gated, system_actor, approver):
    body, _ = gated
    run = drive(run_create(agent_name="gated", actor=system_actor).id)
    _approve(run, approver)

    registry.unregister_tool("gated_write")
    run = drive(run.id)

    assert run.status == Run.Status.SUCCEEDED
    assert run.result["status"] == "failed"
    assert "tool_retired" in run.result["error"]
    assert body.calls == []
    approval = Approval.objects.get(run=run)
    assert (approval.status, approval.consumed_at) == ("cancelled", None)


def test_a_changed_precondition_is_never_dispatched_on_the_old_approval(
    register, system_actor, approver
):
    body = CountingTool()
    world = {"balance": 100}

    def decide(ctx):
        if not ctx.steps:
            return CallTool("guarded_refund", {"order": "o1"})
        return Finish({"status": ctx.last_step.status, "error": ctx.last_step.error})

    tool = make_tool("guarded_refund", body, effect=Effect.IDEMPOTENT, approval=ALWAYS)
    tool.precondition = lambda arguments: f"balance={world['balance']}"
    register(tool, ScriptedAgent("guarded", decide, tools=("guarded_refund",)))
    run = drive(run_create(agent_name="guarded", actor=system_actor).id)
    _approve(run, approver)

    world["balance"] = 40  # someone refunded part of the order meanwhile
    run = drive(run.id)

    assert body.calls == []
    assert run.status == Run.Status.SUCCEEDED
    assert run.result["status"] == "failed"
    (cancelled,) = events(run.id, "tool.cancelled")
    assert cancelled.payload["decided_fingerprint"] == "balance=100"
    assert cancelled.payload["current_fingerprint"] == "balance=40"
    approval = Approval.objects.get(run=run)
    assert approval.consumed_at is None
    assert approval.status == Approval.Status.CANCELLED


# --- the principal ----------------------------------------------------------------------------


@pytest.fixture
def restricted(register):
    body = CountingTool()

    def decide(ctx):
        if not ctx.steps:
            return CallTool("ops_only_write", {})
        return Finish({"status": ctx.last_step.status})

    tool = make_tool("ops_only_write", body, effect=Effect.IDEMPOTENT)
    tool.allowed_groups = ("operator",)
    decisions = []

    def counted(ctx):
        decisions.append(len(ctx.steps))
        return decide(ctx)

    register(tool, ScriptedAgent("restricted", counted, tools=("ops_only_write",)))
    return body, decisions


def test_a_deactivated_principal_pauses_the_run_until_resumed(
    restricted, system_actor, operator, olivia
):
    body, _ = restricted
    run = run_create(agent_name="restricted", actor=olivia)
    operator.is_active = False
    operator.save(update_fields=["is_active"])

    run = drive(run.id)

    assert (run.status, run.reason_code) == (Run.Status.PAUSED, Run.Reason.PRINCIPAL_REVOKED)
    assert "deactivated" in run.reason_detail
    assert body.calls == []
    assert not Step.objects.filter(run=run).exists()

    operator.is_active = True
    operator.save(update_fields=["is_active"])
    run_resume(run_id=run.id, actor=Actor.system("cli"))
    run = drive(run.id)
    assert run.status == Run.Status.SUCCEEDED
    assert len(body.calls) == 1


def test_a_principal_outside_the_tools_groups_pauses_the_run_and_keeps_the_decision(
    restricted, system_actor, viewer
):
    body, decisions = restricted
    run = drive(run_create(agent_name="restricted", actor=system_actor, principal=viewer).id)

    assert (run.status, run.reason_code) == (Run.Status.PAUSED, Run.Reason.PRINCIPAL_REVOKED)
    assert "operator" in run.reason_detail
    call = ToolCall.objects.get(run=run)
    assert call.status == ToolCall.Status.PROPOSED
    assert body.calls == []

    run_resume(run_id=run.id, actor=system_actor)
    run = drive(run.id)  # still not allowed: paused again, never dispatched
    assert run.status == Run.Status.PAUSED
    assert body.calls == []

    viewer.groups.add(Group.objects.get(name="operator"))
    run_resume(run_id=run.id, actor=system_actor)
    run = drive(run.id)

    assert run.status == Run.Status.SUCCEEDED
    assert len(body.calls) == 1
    assert decisions == [0, 1]  # the call was decided once, not asked again


# --- settled is settled (issue 25): no compatibility check fails a call that settled ----------


def _deploy_agent_v2(name: str, decide, tools: tuple[str, ...]) -> None:
    """A deploy: the agent's new version, with a migration from the old one."""
    new = ScriptedAgent(name, decide, tools=tools, version="2")
    new.migrations = [("1", "2", lambda state: {**state, "migrated": True})]
    registry.register_agent(new)


@pytest.fixture
def lost_unsafe_send(register, system_actor):
    """An unsafe call whose outcome was lost: the run waits for a person. The agent sends
    again whenever its last send failed, so a send failed by mistake would go out twice."""
    plan = {"lose": 1}

    def behaviour(arguments, ctx):
        if plan["lose"]:
            plan["lose"] -= 1
            raise OutcomeUnknown("connection reset by peer")

    body = CountingTool(behaviour)

    def decide(ctx):
        if not ctx.steps or ctx.last_step.status == Step.Status.FAILED:
            return CallTool("deploy_unsafe_send", {"to": "c@example.com"})
        return Finish({"output": ctx.last_step.output, "state": dict(ctx.state)})

    register(
        make_tool("deploy_unsafe_send", body, effect=Effect.UNSAFE),
        ScriptedAgent("deploy_sender", decide, tools=("deploy_unsafe_send",)),
    )
    run = drive(run_create(agent_name="deploy_sender", actor=system_actor).id)
    assert (run.status, run.reason_code) == (Run.Status.NEEDS_ATTENTION, "unknown_outcome")
    assert len(body.calls) == 1
    return body, decide, run


def _resolve_happened(run: Run, olivia: Actor) -> ToolCall:
    call = toolcall_resolve(
        tool_call_id=ToolCall.objects.get(run=run).id,
        outcome="happened",
        actor=olivia,
        result={"notification_id": "ntf_7"},
    )
    assert call.receipt.source == ToolReceipt.Source.OPERATOR
    # the agent changed version: the step waits for the migrated state to complete it
    assert Step.objects.get(run=run, seq=1).status == Step.Status.PENDING
    return call


def test_an_unsafe_call_resolved_as_happened_completes_after_its_tool_changed(
    lost_unsafe_send, olivia
):
    body, decide, run = lost_unsafe_send
    _deploy_agent_v2("deploy_sender", decide, ("deploy_unsafe_send",))
    registry.register_tool(
        make_tool(
            "deploy_unsafe_send",
            body,
            effect=Effect.UNSAFE,
            schema={"type": "object", "properties": {"to": {"type": "string"}}},
        )
    )
    _resolve_happened(run, olivia)

    run = drive(run.id)

    assert run.status == Run.Status.SUCCEEDED
    assert run.result == {"output": {"notification_id": "ntf_7"}, "state": {"migrated": True}}
    assert len(body.calls) == 1  # never sent a second time
    step = Step.objects.get(run=run, seq=1)
    assert (step.status, step.output) == (Step.Status.COMPLETED, {"notification_id": "ntf_7"})
    assert ToolCall.objects.get(run=run).status == ToolCall.Status.SUCCEEDED
    assert events(run.id, "tool.cancelled") == []
    assert Step.objects.filter(run=run).count() == 2  # the send, then finish


def test_a_receipt_whose_step_is_open_completes_though_its_tool_was_retired(
    lost_unsafe_send, olivia
):
    body, decide, run = lost_unsafe_send
    registry.unregister_tool("deploy_unsafe_send")
    _deploy_agent_v2("deploy_sender", lambda ctx: Finish({"output": ctx.last_step.output}), ())
    _resolve_happened(run, olivia)

    run = drive(run.id)

    assert run.status == Run.Status.SUCCEEDED
    assert run.result == {"output": {"notification_id": "ntf_7"}}
    assert Step.objects.get(run=run, seq=1).status == Step.Status.COMPLETED
    assert len(body.calls) == 1
    assert "tool_retired" not in (run.reason_code, *event_types(run.id))


def test_a_rejection_reaches_the_agent_with_its_comment_after_the_tool_changed(
    gated, system_actor, approver
):
    body, _ = gated
    run = drive(run_create(agent_name="gated", actor=system_actor).id)
    approval_decide(
        approval_id=Approval.objects.get(run=run).id,
        decision="reject",
        comment="not this month",
        actor=Actor.for_user(approver, "web"),
    )
    registry.register_tool(
        make_tool(
            "gated_write",
            body,
            effect=Effect.IDEMPOTENT,
            approval=ALWAYS,
            schema={"type": "object", "properties": {"amount": {"type": "number"}}},
        )
    )

    run = drive(run.id)

    assert run.status == Run.Status.SUCCEEDED
    assert run.result == {"status": "failed", "error": "approval rejected: not this month"}
    assert body.calls == []
    assert ToolCall.objects.get(run=run).status == ToolCall.Status.REJECTED
    assert events(run.id, "tool.cancelled") == []
    assert events(run.id, "tool.version_changed") == []


# --- a tool's identity covers what it does (issue 25) ------------------------------------------


def _charge_v1(arguments, ctx):
    CHARGED.append(("v1", arguments["amount"]))
    return ToolResult({"charged": arguments["amount"]})


def _charge_v2(arguments, ctx):
    # the same schema and policy; only what it does changed (cents, not units)
    CHARGED.append(("v2", arguments["amount"] * 100))
    return ToolResult({"charged": arguments["amount"] * 100})


CHARGED: list[tuple[str, int]] = []


def _charge_tool(call=_charge_v1, **overrides) -> Tool:
    return Tool(
        **{
            "name": "deploy_charge",
            "effect": Effect.IDEMPOTENT,
            "call": call,
            "schema": {"type": "object", "properties": {"amount": {"type": "integer"}}},
            "approval": ALWAYS,
            "precondition": lambda arguments: "balance=500",
        }
        | overrides
    )


@pytest.fixture
def approved_charge(register, system_actor, approver):
    """A charge of 150 approved on the first tool, not dispatched yet."""
    CHARGED.clear()

    def decide(ctx):
        if not ctx.steps:
            return CallTool("deploy_charge", {"amount": 150})
        return Finish({"status": ctx.last_step.status, "output": ctx.last_step.output})

    tool = _charge_tool()
    register(tool, ScriptedAgent("deploy_charger", decide, tools=("deploy_charge",)))
    run = drive(run_create(agent_name="deploy_charger", actor=system_actor).id)
    _approve(run, approver)
    return run, tool


@pytest.mark.parametrize(
    "changed",
    [
        pytest.param(lambda: _charge_tool(call=_charge_v2), id="behaviour-only"),
        pytest.param(lambda: _charge_tool(precondition=None), id="precondition-removed"),
    ],
)
def test_a_changed_fingerprint_cancels_the_approval_and_asks_again(
    approved_charge, approver, changed
):
    run, old_tool = approved_charge
    new_tool = changed()
    assert new_tool.version != old_tool.version
    registry.register_tool(new_tool)

    run = drive(run.id)

    assert run.status == Run.Status.WAITING_APPROVAL
    assert CHARGED == []  # the changed tool never used the old approval
    old, new = Approval.objects.filter(run=run).order_by("requested_at", "id")
    assert (old.status, old.reason, old.consumed_at) == ("cancelled", "tool_version_changed", None)
    assert (old.tool_version, new.tool_version) == (old_tool.version, new_tool.version)
    assert new.status == Approval.Status.PENDING
    assert ToolCall.objects.get(run=run).tool_version == new_tool.version
    (changed_event,) = events(run.id, "tool.version_changed")
    assert changed_event.payload["from_version"] == old_tool.version
    assert changed_event.payload["to_version"] == new_tool.version

    _approve(run, approver)
    run = drive(run.id)

    assert run.status == Run.Status.SUCCEEDED
    assert len(CHARGED) == 1
    assert Approval.objects.get(id=new.id).consumed_at is not None


def test_a_change_declared_compatible_keeps_the_approval_and_is_recorded(approved_charge, approver):
    run, old_tool = approved_charge
    new_tool = _charge_tool(call=_charge_v2, compatible_with=(old_tool.version,))
    registry.register_tool(new_tool)

    run = drive(run.id)

    assert run.status == Run.Status.SUCCEEDED
    assert CHARGED == [("v2", 15000)]  # what the tool's author declared the same tool
    (approval,) = Approval.objects.filter(run=run)
    assert approval.status == Approval.Status.APPROVED and approval.consumed_at is not None
    (accepted,) = events(run.id, "tool.version_accepted")
    assert (accepted.payload["from_version"], accepted.payload["to_version"]) == (
        old_tool.version,
        new_tool.version,
    )
    assert events(run.id, "tool.version_changed") == []
    # the call keeps the fingerprint it was decided and approved under
    assert ToolCall.objects.get(run=run).tool_version == old_tool.version


# --- parks with a way out ----------------------------------------------------------------------


def test_a_run_parked_for_a_missing_migration_resumes_once_one_is_deployed(
    register, system_actor, olivia
):
    register(_counter("1"))
    run = run_create(agent_name="versioned", actor=system_actor)
    Run.objects.filter(id=run.id).update(state={"count": 2})
    registry.register_agent(_counter("2"))  # deployed without a migration
    run = drive(run.id)
    assert (run.status, run.reason_code) == (
        Run.Status.NEEDS_ATTENTION,
        "incompatible_agent_version",
    )

    # retrying before a migration exists is refused and says what to do
    with (
        pytest.raises(InvalidState, match="no state migration leads from versioned version 1"),
        transaction.atomic(),
    ):
        run_retry_recovery(run_id=run.id, actor=olivia)
    run.refresh_from_db()
    assert run.status == Run.Status.NEEDS_ATTENTION

    registry.register_agent(_counter("2", migrations=[("1", "2", lambda s: {"n": s["count"]})]))
    run_retry_recovery(run_id=run.id, actor=olivia)
    run = drive(run.id)

    assert run.status == Run.Status.SUCCEEDED
    assert run.result == {"n": 2}
    assert events(run.id, "run.recovery_retried")[0].payload["reason"] == (
        "incompatible_agent_version"
    )
    assert [e.payload["to"] for e in events(run.id, "run.migrated")] == ["2"]


@pytest.fixture
def fragile(register):
    """A refund whose precondition reads a resource that can disappear."""
    body = CountingTool()
    world: dict = {"order": {"balance": 100}}

    def precondition(arguments):
        return f"balance={world['order']['balance']}"  # KeyError once the order is gone

    def decide(ctx):
        if not ctx.steps:
            return CallTool("fragile_refund", {"order": "o1"})
        return Finish({"status": ctx.last_step.status, "error": ctx.last_step.error})

    tool = make_tool("fragile_refund", body, effect=Effect.IDEMPOTENT, approval=ALWAYS)
    tool.precondition = precondition
    register(tool, ScriptedAgent("fragile", decide, tools=("fragile_refund",)))
    return body, world


def test_a_precondition_that_raises_at_dispatch_parks_the_run_once_with_the_error(
    fragile, system_actor, approver, olivia
):
    body, world = fragile
    run = drive(run_create(agent_name="fragile", actor=system_actor).id)
    _approve(run, approver)
    world.pop("order")  # the resource was deleted while the approval waited

    run = drive(run.id)

    assert (run.status, run.reason_code) == (Run.Status.NEEDS_ATTENTION, "precondition_failed")
    assert "KeyError" in run.reason_detail and "fragile_refund" in run.reason_detail
    assert run.recovery_count == 0  # parked at once, no crash loop
    assert body.calls == []
    assert ToolCall.objects.get(run=run).status == ToolCall.Status.APPROVED

    world["order"] = {"balance": 100}  # the resource is back, unchanged
    run_retry_recovery(run_id=run.id, actor=olivia)
    run = drive(run.id)

    assert run.status == Run.Status.SUCCEEDED
    assert run.result["status"] == "completed"
    assert len(body.calls) == 1
    assert Approval.objects.get(run=run).consumed_at is not None


def test_a_precondition_that_raises_when_the_call_is_decided_is_a_refused_call(
    fragile, system_actor
):
    body, world = fragile
    world.pop("order")

    run = drive(run_create(agent_name="fragile", actor=system_actor).id)

    assert run.status == Run.Status.SUCCEEDED
    assert run.result["status"] == "failed"
    assert run.result["error"].startswith("precondition raised: KeyError")
    assert not ToolCall.objects.filter(run=run).exists()
    assert body.calls == []


def test_a_fork_carries_the_signals_the_old_run_received_but_did_not_consume(
    register, system_actor, olivia
):
    from runs.waits import run_signal

    body = CountingTool()

    def decide(ctx):
        if not ctx.steps:
            return CallTool("versioned_read", {"n": 0})
        if len(ctx.steps) == 1:
            return WaitForSignal("go")
        return Finish({"go": ctx.last_step.output})

    register(
        make_tool("versioned_read", body),
        ScriptedAgent("signalled", decide, tools=("versioned_read",)),
    )
    run = drive(run_create(agent_name="signalled", actor=system_actor).id)
    assert run.status == Run.Status.WAITING_EVENT
    with transaction.atomic():
        run_signal(run_id=run.id, name="go", payload={"ok": 1}, actor=olivia)
    # an early signal for a later wait, kept by the old run
    with transaction.atomic():
        run_signal(run_id=run.id, name="later", payload=None, actor=olivia)

    # the fork leaves the wait that consumed "go" behind: both signals come with it
    fork = run_fork(run_id=run.id, actor=olivia, from_step=1)
    fork = drive(fork.id)

    assert fork.status == Run.Status.SUCCEEDED
    assert fork.result == {"go": {"ok": 1}}
    forked = events(fork.id, "run.forked")[0].payload
    assert forked["carried_signals"] == ["go", "later"]
    assert len(body.calls) == 1  # the carried read was not repeated


def test_a_fork_can_act_as_the_person_who_forks_it_and_says_so(
    register, system_actor, operator, olivia, django_user_model
):
    body = CountingTool()
    decide = lambda ctx: CallTool("versioned_read", {"n": 0}) if not ctx.steps else Finish({})  # noqa: E731
    register(
        make_tool("versioned_read", body), ScriptedAgent("owned", decide, tools=("versioned_read",))
    )
    leaver = django_user_model.objects.create_user(username="leaver", password="pw")
    leaver.groups.add(Group.objects.get(name="operator"))
    run = drive(run_create(agent_name="owned", actor=Actor.for_user(leaver, "web")).id)
    assert run.status == Run.Status.SUCCEEDED
    leaver.is_active = False  # left the company: a fork acting as them would pause at once
    leaver.save()

    fork = run_fork(run_id=run.id, actor=olivia, from_step=1, as_me=True)

    assert fork.principal_id == operator.pk
    forked = events(fork.id, "run.forked")[0]
    assert forked.payload["principal"] == {"from": "leaver", "to": operator.get_username()}
    assert f"acting as {operator.get_username()} (was leaver)" in describe(
        forked.type, forked.payload
    )
    assert drive(fork.id).status == Run.Status.SUCCEEDED
    with pytest.raises(InvalidInput), transaction.atomic():
        run_fork(run_id=fork.id, actor=system_actor, from_step=1, as_me=True)

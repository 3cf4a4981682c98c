"""Every state change of a run that is not the engine advancing it.

Each function checks permission, runs in one transaction with the run row locked, guards
the status, appends events naming the actor, and enqueues work on commit. HTML views, the
API, admin actions and workers all call these; a transition is never written twice.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from decimal import Decimal
from typing import Any

from django.conf import settings
from django.db import models, transaction
from django.db.models.functions import Now
from django.utils import timezone

from runs.actors import Actor
from runs.errors import InvalidInput, InvalidState
from runs.models import Run, RunEvent, Signal, Step, ToolCall, ToolReceipt
from runs.queue import enqueue_on_commit
from runs.record import runs as record_runs
from runs.record import transitions
from runs.record.checkpoint import Checkpoint, checkpoint
from runs.record.eventtypes import EventType
from runs.record.runs import run_pause as record_pause
from runs.record.runs import run_queue
from runs.record.runs import run_terminate as record_terminate
from runs.registry import Effect, UnknownAgent, UnknownTool, registry
from runs.selectors import toolcall_absence_proven

__all__ = ["InvalidInput", "InvalidState"]  # the domain errors services raise (runs.errors)


@contextmanager
def service_checkpoint(run_id: Any, *, actor: Actor) -> Iterator[Checkpoint]:
    """A service's locking checkpoint in a transaction of its own. ``checkpoint()`` alone joins
    a caller's transaction (``atomic(savepoint=False)``: the engine's hot path pays for no
    savepoint); a service owns a savepoint instead, so a refusal inside it rolls back this
    service's writes only and leaves a caller's transaction usable — a request's
    (``ATOMIC_REQUESTS``), a test's, or a bulk action's applying one run after another.
    Outside any transaction the savepoint is the transaction: nothing more is paid."""
    with (
        transaction.atomic(),
        checkpoint(run_id, actor=actor.label, channel=actor.channel) as cp,
    ):
        yield cp


class UnsafeDispatchUnconfirmed(InvalidState):
    """Dispatching an ``unsafe`` tool again may repeat its effect: the operator must say so."""

    code = "unsafe_dispatch_unconfirmed"
    status = 400


class AttestationRequired(InvalidInput):
    """Marking an unknown outcome failed, or sending an unlookupable call again, without a
    lookup that proves absence: the person must attest why, in words that are recorded."""

    code = "attestation_required"
    status = 400


class DryRunUnsupported(InvalidInput):
    """A dry run of an agent one of whose tools that are not ``read`` declares no dry-run
    behaviour: such a tool could only be called for real, so the run is refused."""

    code = "dry_run_unsupported"
    status = 400

    def __init__(self, agent_name: str, tools: list[str]) -> None:
        self.tools = tools
        super().__init__(
            f"agent {agent_name} cannot be dry-run: these tools have side effects and declare "
            f"no dry_run: {', '.join(tools)}"
        )


class AlreadyPromoted(InvalidState):
    """A dry run is promoted (started for real) once."""

    code = "already_promoted"
    status = 409


class BudgetExhausted(InvalidState):
    """A top-up that would leave the run's budget still exhausted."""

    code = "budget_exhausted"
    status = 409


def _validate_input(agent: Any, input: Any) -> None:
    import jsonschema

    validator = jsonschema.Draft202012Validator(agent.input_schema)
    errors = [
        f"{'/'.join(str(p) for p in e.absolute_path) or '(root)'}: {e.message}"
        for e in validator.iter_errors(input)
    ]
    if errors:
        raise InvalidInput("input does not match the agent's schema: " + "; ".join(errors))


def run_create(
    *,
    agent_name: str,
    goal: str = "",
    input: dict[str, Any] | None = None,
    actor: Actor,
    principal: Any = None,
    max_steps: int | None = None,
    max_cost: Decimal | None = None,
    max_tokens: int | None = None,
    deadline: Any = None,
    dry_run: bool = False,
    promoted_from: Run | None = None,
) -> Run:
    """Create a run and enqueue it. Unknown agents and bad input raise before anything is
    written. ``dry_run``: refused (``DryRunUnsupported``, naming the tools) unless every tool
    of the agent that is not ``read`` declares its dry-run behaviour."""
    actor.require("runs.start_run")
    agent = registry.agent(agent_name)  # raises UnknownAgent
    input = dict(input or {})
    _validate_input(agent, input)
    if dry_run:
        missing = agent.tools_without_dry_run()
        if missing:
            raise DryRunUnsupported(agent.name, missing)
    if principal is None:
        principal = actor.user
    run_id = uuid.uuid4()
    with transaction.atomic():
        run = Run.objects.create(
            id=run_id,
            agent_name=agent.name,
            agent_version=agent.version,
            goal=goal,
            input=input,
            state=agent.initial_state(input),
            principal=principal,
            max_steps=max_steps
            if max_steps is not None
            else settings.AGENTOPS["DEFAULT_MAX_STEPS"],
            max_cost=max_cost,
            max_tokens=max_tokens,
            deadline=deadline,
            trace_id=uuid.uuid4().hex,
            root_run_id=run_id,
            enqueued_at=timezone.now(),
            # an LLM-backed agent's model is pinned here, for the run's whole life
            model_id=agent.model_for_new_run() if hasattr(agent, "model_for_new_run") else "",
            dry_run=dry_run,
            promoted_from=promoted_from,
        )
        with checkpoint(run.id, actor=actor.label, channel=actor.channel) as cp:
            cp.event(
                EventType.RUN_CREATED,
                agent=agent.name,
                agent_version=agent.version,
                goal=goal,
                **({"model": run.model_id} if run.model_id else {}),
                principal=principal.get_username() if principal is not None else None,
                budget={"max_steps": run.max_steps, "max_cost": max_cost, "max_tokens": max_tokens},
                # only when set: a real run's event is what it always was
                **({"dry_run": True} if dry_run else {}),
                **({"promoted_from": str(promoted_from.id)} if promoted_from else {}),
            )
        enqueue_on_commit(run.id)
    return run


def run_promote(*, run_id: Any, actor: Actor) -> Run:
    """Start a finished dry run for real: a new run of the same agent with the same goal,
    input and budget limits, acting as the person (or account) who promotes it. Nothing of
    the dry run is reused — its decisions, receipts and approvals stay its own (the new run
    is its own root: new idempotency keys, approvals asked again). Linked both ways: the new
    run's ``promoted_from`` and ``run.created``, the dry run's ``run.promoted``. A dry run is
    promoted once (``AlreadyPromoted``; the one-to-one link refuses a second even under a
    race)."""
    actor.require("runs.start_run")
    with service_checkpoint(run_id, actor=actor) as cp:
        source = Run.objects.get(id=run_id)  # under the lock cp holds
        if not source.dry_run:
            raise InvalidState("only a dry run can be promoted; this run is real")
        if source.status not in Run.TERMINAL:
            raise InvalidState(f"the dry run is {source.status}: promote it once it has finished")
        promoted = Run.objects.filter(promoted_from_id=source.id).values_list("id", flat=True)
        if promoted:
            raise AlreadyPromoted(f"this dry run was already promoted to run {promoted[0]}")
        run = run_create(
            agent_name=source.agent_name,
            goal=source.goal,
            input=source.input,
            actor=actor,
            max_steps=source.max_steps,
            max_cost=source.max_cost,
            max_tokens=source.max_tokens,
            # a deadline that has passed would stop the real run at once: it is dropped
            deadline=source.deadline
            if source.deadline is not None and source.deadline > timezone.now()
            else None,
            promoted_from=source,
        )
        cp.event(EventType.RUN_PROMOTED, to_run=str(run.id), by=actor.label)
    return run


def _lease_is_live(run_id: Any) -> bool:
    return Run.objects.filter(id=run_id, lease_expires_at__gt=Now()).exists()


def run_terminate(*, run_id: Any, actor: Actor, reason: str) -> Run:
    """Terminate now when no process holds the lease; otherwise ask the holder, which
    honours the request at its next boundary (after recording any in-flight receipt)."""
    actor.require("runs.operate_run")
    if not reason.strip():
        raise InvalidInput("a reason is required to terminate a run")
    with service_checkpoint(run_id, actor=actor) as cp:
        if cp.run.status in Run.TERMINAL:
            raise InvalidState(f"run is already {cp.run.status}")
        if cp.run.status == Run.Status.RUNNING and _lease_is_live(run_id):
            cp.event(EventType.RUN_TERMINATE_REQUESTED, by=actor.label, reason=reason)
            cp.update(
                requested_action=Run.Request.TERMINATE,
                requested_by=actor.label,
                requested_reason=reason,
            )
        else:
            record_terminate(cp, by=actor.label, reason=reason)
    return Run.objects.get(id=run_id)


def run_pause(*, run_id: Any, actor: Actor, reason: str = "") -> Run:
    actor.require("runs.operate_run")
    with service_checkpoint(run_id, actor=actor) as cp:
        status = cp.run.status
        if status not in (Run.Status.QUEUED, Run.Status.RUNNING):
            raise InvalidState(f"a {status} run cannot be paused")
        if status == Run.Status.RUNNING and _lease_is_live(run_id):
            cp.event(EventType.RUN_PAUSE_REQUESTED, by=actor.label, reason=reason)
            cp.update(
                requested_action=Run.Request.PAUSE,
                requested_by=actor.label,
                requested_reason=reason,
            )
        else:
            record_pause(cp, by=actor.label, reason=reason)
    return Run.objects.get(id=run_id)


def run_resume(*, run_id: Any, actor: Actor) -> Run:
    actor.require("runs.operate_run")
    with service_checkpoint(run_id, actor=actor) as cp:
        if cp.run.status != Run.Status.PAUSED:
            raise InvalidState(f"a {cp.run.status} run cannot be resumed")
        record_runs.run_resume(cp, by=actor.label)
    return Run.objects.get(id=run_id)


def toolcall_gate_settled(
    *, cp: Checkpoint, call: ToolCall, approved: bool, reason: str = ""
) -> None:
    """Called by the approvals app inside its decision transaction (``cp`` locks the run):
    the call's approval settled. The run becomes runnable again; on rejection the agent sees
    the rejection as the step's outcome."""
    if call.status != ToolCall.Status.AWAITING_APPROVAL:
        raise InvalidState(f"tool call is {call.status}, not awaiting approval")
    transitions.call_gate_settled(call, approved=approved, reason=reason)
    if cp.run.status == Run.Status.WAITING_APPROVAL:
        run_queue(cp)


# --- resolving an unknown outcome (DESIGN §5.3) -------------------------------------------------


class Resolution:
    HAPPENED = "happened"
    NOT_HAPPENED = "not_happened"
    DISPATCH_AGAIN = "dispatch_again"
    RECONCILE = "reconcile"

    ALL = (HAPPENED, NOT_HAPPENED, DISPATCH_AGAIN, RECONCILE)


ATTESTATION_MAX = 2000


def toolcall_resolve(
    *,
    tool_call_id: Any,
    outcome: str,
    actor: Actor,
    external_ref: str = "",
    result: Any = None,
    confirm_risk: bool = False,
    attestation: str = "",
) -> ToolCall:
    """An operator's answer to a call whose outcome is unknown, on a run that waits for a
    person. ``happened``: a receipt (source ``operator``) and the step completes;
    ``not_happened``: the step fails and the agent decides what next; ``dispatch_again``: the
    call is sent again with the same idempotency key (an ``unsafe`` tool only with
    ``confirm_risk``); ``reconcile``: the engine looks the key up again from scratch. The
    run is queued again either way.

    ``not_happened`` is allowed as a matter of record only where a lookup that started
    after the landing deadline answered absent (``toolcall_absence_proven``); otherwise the
    person gives an ``attestation`` — why they know it did not happen — recorded in
    ``tool.resolved``. The same rule for every channel, one call or many."""
    actor.require("runs.resolve_toolcall")
    if outcome not in Resolution.ALL:
        raise InvalidInput(f"outcome must be one of {', '.join(Resolution.ALL)}")
    run_id = ToolCall.objects.values_list("run_id", flat=True).get(id=tool_call_id)
    with service_checkpoint(run_id, actor=actor) as cp:
        call = ToolCall.objects.select_related("step").get(id=tool_call_id)
        if cp.run.status != Run.Status.NEEDS_ATTENTION:
            raise InvalidState(f"the run is {cp.run.status}, not waiting for a person")
        if call.status != ToolCall.Status.UNKNOWN:
            raise InvalidState(f"the call is {call.status}; only an unknown outcome is resolved")
        try:
            tool = registry.tool(call.tool_name)
        except UnknownTool:
            tool = None
        current = tool is not None and tool.accepts(call.tool_version)
        if outcome in (Resolution.DISPATCH_AGAIN, Resolution.RECONCILE) and not current:
            raise InvalidState(
                f"tool {call.tool_name} version {call.tool_version} is retired: "
                "resolve the call as happened or not_happened"
            )
        if outcome == Resolution.RECONCILE and (
            tool.reconcile is None or tool.effect == Effect.UNSAFE
        ):
            raise InvalidState(f"tool {call.tool_name} has no lookup by key to reconcile with")
        unsafe = call.effect == Effect.UNSAFE
        attestation = " ".join(attestation.split())
        if len(attestation) > ATTESTATION_MAX:
            raise InvalidInput(f"the attestation must be at most {ATTESTATION_MAX} characters")
        proven = toolcall_absence_proven(call=call)
        if outcome == Resolution.NOT_HAPPENED and not proven and not attestation:
            raise AttestationRequired(
                f"no lookup that started after the landing deadline found call "
                f"#{call.step.seq} ({call.tool_name}) absent: attest why you know it did not "
                "happen (a call marked failed that had succeeded lets the agent act again "
                "under a new key)"
            )
        if outcome == Resolution.DISPATCH_AGAIN and unsafe and not confirm_risk:
            raise UnsafeDispatchUnconfirmed(
                f"{call.tool_name} is unsafe: sending it again may repeat its effect; "
                "confirm the risk to dispatch it again"
            )
        cp.event(
            EventType.TOOL_RESOLVED,
            seq=call.step.seq,
            tool=call.tool_name,
            idempotency_key=call.idempotency_key,
            outcome=outcome,
            by=actor.label,
            external_ref=external_ref,
            confirmed_risk=bool(confirm_risk and unsafe and outcome == Resolution.DISPATCH_AGAIN),
            absence_proven=proven,
            attestation=attestation,
        )
        if outcome in (Resolution.HAPPENED, Resolution.NOT_HAPPENED):
            _settle_by_operator(
                cp,
                call,
                happened=outcome == Resolution.HAPPENED,
                result=result,
                external_ref=external_ref,
                actor=actor,
            )
        else:
            # Both start the unknown-outcome rules afresh: reconcile_attempts counts the
            # lookups since the last person looked at the call.
            ToolCall.objects.filter(id=call.id).update(
                reconcile_attempts=0,
                next_reconcile_at=None,
                redispatch_authorized=outcome == Resolution.DISPATCH_AGAIN,
                # a remote agent's accepted absent is used up too: it looks the key up again
                # (a lookup that starts after the landing deadline) before a re-send
                absent_lookup=None,
                updated_at=timezone.now(),
            )
        _requeue(cp, run_id)
    call.refresh_from_db()
    return call


def _settle_by_operator(
    cp: Checkpoint, call: ToolCall, *, happened: bool, result: Any, external_ref: str, actor: Actor
) -> None:
    transitions.record_receipt(
        cp,
        call,
        ok=happened,
        result=result if happened else {"error": "the operator found it did not happen"},
        external_ref=external_ref,
        source=ToolReceipt.Source.OPERATOR,
        recorded_by=actor.label,
        incarnation=None,
    )
    run = Run.objects.get(id=cp.run.id)  # the whole row (state), under the lock cp holds
    try:
        agent = registry.agent(run.agent_name)
    except UnknownAgent:
        agent = None
    if agent is None or agent.version != run.agent_version:
        # The step stays open with its receipt: the engine completes it after it migrated
        # the state (or the run is forked), so an old state never meets new code.
        return
    transitions.complete_step(
        cp,
        run=run,
        agent=agent,
        step=call.step,
        ok=happened,
        output=result if happened else None,
        error="" if happened else f"did not happen (resolved by {actor.label})",
    )


def _requeue(cp: Checkpoint, run_id: Any) -> None:
    run_queue(cp, reason_code="", reason_detail="", wake_at=None)


# --- budgets and the dead letter ----------------------------------------------------------------


def _budget_exhaustion(run: Run) -> str:
    """The engine's rule (``runs.engine.budget_exhausted``) in wall-clock time: used here to
    refuse a top-up that would not let the run go on."""
    if run.max_steps is not None and run.steps_used >= run.max_steps:
        return f"{run.steps_used} of {run.max_steps} steps used"
    if run.max_cost is not None and run.cost_used >= run.max_cost:
        return f"cost {run.cost_used} of {run.max_cost} used"
    if run.max_tokens is not None and run.tokens_used >= run.max_tokens:
        return f"{run.tokens_used} of {run.max_tokens} tokens used"
    if run.deadline is not None and timezone.now() >= run.deadline:
        return f"the deadline {run.deadline.isoformat()} has passed"
    return ""


_MAX_COST_LIMIT = Decimal(10**6)  # Run.max_cost: 12 digits, 6 of them decimals
_MAX_STEPS_LIMIT = 2**31 - 1  # Run.max_steps: a PositiveIntegerField


def run_topup_budget(
    *,
    run_id: Any,
    actor: Actor,
    add_steps: int = 0,
    add_cost: Decimal | None = None,
    add_tokens: int = 0,
    deadline: Any = None,
) -> Run:
    """Raise a run's limits (usage is never touched). A run stopped with ``budget_exhausted``
    is queued again; a live run simply gets the higher limits. A limit that was unlimited
    stays unlimited."""
    actor.require("runs.operate_run")
    add_cost = Decimal(add_cost) if add_cost is not None else Decimal(0)
    if add_steps < 0 or add_tokens < 0 or add_cost < 0:
        raise InvalidInput("a top-up only raises limits")
    if not (add_steps or add_tokens or add_cost or deadline is not None):
        raise InvalidInput("nothing to top up")
    if deadline is not None and deadline <= timezone.now():
        raise InvalidInput("the new deadline must be in the future")
    with service_checkpoint(run_id, actor=actor) as cp:
        run = Run.objects.get(id=run_id)  # usage and limits, under the lock cp holds
        exhausted = (
            run.status == Run.Status.NEEDS_ATTENTION
            and run.reason_code == Run.Reason.BUDGET_EXHAUSTED
        )
        if run.status in Run.TERMINAL or (
            run.status == Run.Status.NEEDS_ATTENTION and not exhausted
        ):
            reason = f" ({run.reason_code})" if run.reason_code else ""
            raise InvalidState(f"a {run.status}{reason} run's budget cannot be topped up")
        before = _limits(run)
        if add_steps and run.max_steps is not None:
            run.max_steps += add_steps
        if add_cost and run.max_cost is not None:
            run.max_cost += add_cost
        if add_tokens and run.max_tokens is not None:
            run.max_tokens += add_tokens
        if deadline is not None:
            run.deadline = deadline
        # the columns' ranges: past them the UPDATE would fail (a 500), not refuse
        if run.max_cost is not None and run.max_cost >= _MAX_COST_LIMIT:
            raise InvalidInput(f"the cost limit would be {run.max_cost}; it must stay below 10^6")
        if run.max_steps is not None and run.max_steps > _MAX_STEPS_LIMIT:
            raise InvalidInput(f"the step limit would be {run.max_steps}; at most 2^31 - 1")
        still = _budget_exhaustion(run)
        if exhausted and still:
            raise BudgetExhausted(f"the budget would still be exhausted: {still}")
        after = _limits(run)
        cp.event(
            EventType.RUN_BUDGET_TOPPED_UP,
            by=actor.label,
            before=before,
            after=after,
            usage={"steps": run.steps_used, "cost": run.cost_used, "tokens": run.tokens_used},
        )
        cp.update(
            max_steps=run.max_steps,
            max_cost=run.max_cost,
            max_tokens=run.max_tokens,
            deadline=run.deadline,
        )
        if exhausted:
            _requeue(cp, run_id)
    return Run.objects.get(id=run_id)


def _limits(run: Run) -> dict[str, Any]:
    return {
        "max_steps": run.max_steps,
        "max_cost": run.max_cost,
        "max_tokens": run.max_tokens,
        "deadline": run.deadline.isoformat() if run.deadline else None,
    }


# Parks whose cause a deploy or a fix elsewhere can remove: a retry queues the run again and
# the engine checks everything again at the claim (and parks it again if nothing changed).
RETRYABLE = (
    Run.Reason.RECOVERY_LIMIT,
    Run.Reason.INCOMPATIBLE_AGENT_VERSION,
    Run.Reason.PRECONDITION_FAILED,
    Run.Reason.MODEL_UNAVAILABLE,
)


def run_retry_recovery(*, run_id: Any, actor: Actor) -> Run:
    """Another go for a run parked for a cause that may be gone: a dead-lettered run
    (recovered more than ``MAX_RECOVERIES`` times: ``recovery_count`` is history and is kept,
    the limit counts recoveries from here), one whose state migration was missing (refused
    while no migration path is deployed), or one whose tool precondition raised."""
    actor.require("runs.operate_run")
    with service_checkpoint(run_id, actor=actor) as cp:
        run = Run.objects.only(
            "status", "reason_code", "recovery_count", "agent_name", "agent_version", "model_id"
        ).get(id=run_id)
        if not (run.status == Run.Status.NEEDS_ATTENTION and run.reason_code in RETRYABLE):
            raise InvalidState(
                "only a run stopped at its recovery limit, for a missing state migration, a "
                "failing tool precondition or a model that is gone can be retried"
            )
        if run.reason_code == Run.Reason.INCOMPATIBLE_AGENT_VERSION:
            _require_migration_path(run)
        if run.reason_code == Run.Reason.MODEL_UNAVAILABLE:
            # the way out of a withdrawn model: follow the configured one, recorded as the
            # agent's ``model_policy = "follow"`` would record it
            try:
                agent = registry.agent(run.agent_name)
            except UnknownAgent as exc:
                raise InvalidState(str(exc)) from None
            to = _configured_model(agent, run)
            cp.event(
                EventType.RUN_MODEL_CHANGED, **{"from": run.model_id, "to": to}, by=actor.label
            )
            cp.update(model_id=to)
        cp.event(
            EventType.RUN_RECOVERY_RETRIED,
            by=actor.label,
            recovery_count=run.recovery_count,
            reason=run.reason_code,
        )
        if run.reason_code == Run.Reason.RECOVERY_LIMIT:
            cp.update(recovery_count_at_retry=run.recovery_count)
        _requeue(cp, run_id)
    return Run.objects.get(id=run_id)


def _require_migration_path(run: Run) -> None:
    try:
        agent = registry.agent(run.agent_name)
    except UnknownAgent:
        raise InvalidState(
            f"agent {run.agent_name!r} is not registered on this server: deploy it, then retry"
        ) from None
    if agent.migration_path(run.agent_version) is None:
        raise InvalidState(
            f"no state migration leads from {run.agent_name} version {run.agent_version} to "
            f"the registered version {agent.version}: deploy one, then retry; or fork the run"
        )


# --- forking (DESIGN §5.2) --------------------------------------------------------------------


def run_fork(
    *,
    run_id: Any,
    actor: Actor,
    from_step: int,
    agent_version: str | None = None,
    as_me: bool = False,
) -> Run:
    """Continue a run on today's agent from one of its finished steps: a new run in the same
    family (``root_run``, so idempotency keys are kept), the steps up to ``from_step`` with
    their calls and receipts carried over, usage carried over (a fork never resets it), its
    state rebuilt by today's agent from those steps, and the signals the old run received
    that no carried step consumed. The old run is terminated.

    The fork keeps the old run's model, unless that model is gone (``model_unavailable``):
    then it takes the agent's configured one. ``as_me``: the fork acts as the person who
    forks it instead of the old run's principal (one whose account was deactivated, say) —
    never as someone else, so a fork grants nobody more than they have; recorded."""
    actor.require("runs.operate_run")
    if as_me and actor.user is None:
        raise InvalidInput("only a person can fork a run to act as themselves")
    source = Run.objects.get(id=run_id)
    try:
        agent = registry.agent(source.agent_name)
    except UnknownAgent as exc:
        raise InvalidState(str(exc)) from None
    if agent_version is not None and agent_version != agent.version:
        raise InvalidInput(
            f"only the registered version of {agent.name} ({agent.version}) can be forked onto"
        )
    new_id = uuid.uuid4()
    with service_checkpoint(run_id, actor=actor) as cp:
        source = Run.objects.get(id=run_id)
        if source.status == Run.Status.RUNNING and _lease_is_live(run_id):
            raise InvalidState("the run is being driven: pause or terminate it first")
        if RunEvent.objects.filter(run_id=run_id, type=EventType.RUN_PRUNED).exists():
            # ``prune`` emptied its step outputs: a state rebuilt from them would be wrong
            raise InvalidState("the run's step data was pruned (retention); it cannot be forked")
        family = Run.objects.filter(root_run_id=source.root_run_id or source.id)
        if family.exclude(id=source.id).exclude(status__in=Run.TERMINAL).exists():
            # one live branch per family: two could dispatch the same key at once
            raise InvalidState("another run of this family is still live")
        steps = list(
            Step.objects.filter(run_id=run_id, seq__lte=from_step)
            .select_related("tool_call__receipt")
            .order_by("seq")
        )
        if not steps or steps[-1].seq != from_step:
            raise InvalidInput(f"the run has no step {from_step}")
        _check_carryable(steps)
        state = agent.initial_state(source.input)
        for step in steps:
            state = agent.apply(dict(state), transitions.step_view(step))
        model_id = source.model_id
        if source.reason_code == Run.Reason.MODEL_UNAVAILABLE:
            model_id = _configured_model(agent, source)
        principal_id = actor.user.pk if as_me else source.principal_id
        fork = Run.objects.create(
            id=new_id,
            agent_name=agent.name,
            agent_version=agent.version,
            goal=source.goal,
            input=source.input,
            state=state,
            state_version=len(steps),
            principal_id=principal_id,
            max_steps=source.max_steps,
            max_cost=source.max_cost,
            max_tokens=source.max_tokens,
            deadline=source.deadline,
            # usage is what was spent: carried over whole, never reset by a fork
            steps_used=source.steps_used,
            cost_used=source.cost_used,
            tokens_used=source.tokens_used,
            trace_id=uuid.uuid4().hex,
            root_run_id=source.root_run_id or source.id,
            # a fork continues the same conversation: same model (unless it is gone)
            model_id=model_id,
            forked_from=source,
            forked_from_step=from_step,
            enqueued_at=timezone.now(),
            # a fork of a dry run is a dry run: its family's keys and approvals are simulated
            dry_run=source.dry_run,
        )
        transitions.steps_carry(fork, steps)
        signals = _carry_signals(fork, source, from_step)
        if source.status not in Run.TERMINAL:
            record_terminate(cp, by=actor.label, reason=f"forked to run {new_id}")
        cp.event(EventType.RUN_FORKED, to_run=new_id, from_step=from_step, by=actor.label)
        with checkpoint(new_id, actor=actor.label, channel=actor.channel) as fork_cp:
            fork_cp.event(
                EventType.RUN_CREATED,
                agent=agent.name,
                agent_version=agent.version,
                goal=fork.goal,
                principal=fork.principal.get_username() if fork.principal_id else None,
                budget=_limits(fork),
                **({"dry_run": True} if fork.dry_run else {}),
            )
            fork_cp.event(
                EventType.RUN_FORKED,
                from_run=source.id,
                from_step=from_step,
                from_agent_version=source.agent_version,
                agent_version=agent.version,
                carried_steps=[step.seq for step in steps],
                carried_signals=signals,
                **(
                    {
                        "principal": {
                            "from": _username(source.principal),
                            "to": _username(fork.principal),
                        }
                    }
                    if principal_id != source.principal_id
                    else {}
                ),
                **(
                    {"model": {"from": source.model_id, "to": model_id}}
                    if model_id != source.model_id
                    else {}
                ),
                usage={
                    "steps": fork.steps_used,
                    "cost": fork.cost_used,
                    "tokens": fork.tokens_used,
                },
                by=actor.label,
            )
        enqueue_on_commit(new_id)
    return Run.objects.get(id=new_id)


def _check_carryable(steps: list[Step]) -> None:
    finished_calls = (
        ToolCall.Status.SUCCEEDED,
        ToolCall.Status.FAILED,
        ToolCall.Status.REJECTED,
        ToolCall.Status.CANCELLED,
    )
    for step in steps:
        if step.status == Step.Status.PENDING:
            raise InvalidInput(f"step {step.seq} is not finished: fork from an earlier step")
        if step.kind in (Step.Kind.FINISH, Step.Kind.FAIL):
            raise InvalidInput(f"step {step.seq} ended the run: fork from an earlier step")
        call = getattr(step, "tool_call", None)
        if call is not None and call.status not in finished_calls:
            raise InvalidInput(
                f"step {step.seq}'s call has an {call.status} outcome: resolve it, or fork "
                "from an earlier step (the fork then meets the same key and reconciles it)"
            )


def _username(user: Any) -> str | None:
    return user.get_username() if user is not None else None


def _carry_signals(fork: Run, source: Run, from_step: int) -> list[str]:
    """Signals the old run received that no carried step consumed — kept, or consumed by a
    step the fork leaves behind — are the fork's too: a wait it decides again finds them
    instead of waiting for ever for a signal its sender already sent. Copies (the old run's
    rows stay for its record), in the order they arrived; their names."""
    pending = (
        Signal.objects.filter(run=source)
        .filter(models.Q(consumed_at__isnull=True) | models.Q(consumed_by_step__seq__gt=from_step))
        .order_by("received_at", "id")
    )
    names = []
    for signal in pending:
        Signal.objects.create(
            run=fork,
            name=signal.name,
            payload=signal.payload,
            idempotency_key=signal.idempotency_key,
            sent_by=signal.sent_by,
            channel=signal.channel,
        )
        names.append(signal.name)
    return names


def _configured_model(agent: Any, run: Run) -> str:
    """The model a run whose own model is gone moves to: the agent's configured one, which
    must be another."""
    configured = agent.model_for_new_run() if hasattr(agent, "model_for_new_run") else ""
    if not configured:
        raise InvalidState(f"no model is configured for {run.agent_name} (AGENTOPS_LLM_MODEL)")
    if configured == run.model_id:
        raise InvalidState(
            f"the configured model is still {configured}, the one that is gone: configure "
            "another (AGENTOPS_LLM_MODEL), then retry"
        )
    return configured

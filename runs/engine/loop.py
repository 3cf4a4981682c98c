"""The loop: ``advance`` claims a run and drives it for one slice, after the checks every
claim makes before anything new is decided (DESIGN §5: agent version, model policy, recovery
limit, principal, budgets)."""

from __future__ import annotations

import copy
import time
from collections.abc import Callable
from contextlib import ExitStack, nullcontext
from datetime import timedelta
from typing import Any

from runs import logs, spend, tracing
from runs.engine import serving
from runs.engine.claim import claim
from runs.engine.continuing import _continue_step
from runs.engine.deciding import _decide
from runs.engine.lease import (
    Lease,
    Outcome,
    _conf,
    _describe,
    _yield,
    finish,
    log,
    park_needs_attention,
    pause_principal_revoked,
    principal_refusal,
)
from runs.engine.toolcalls import _LeaseKeeper
from runs.models import Run, SpendReservation, Step
from runs.record import configcache, transitions
from runs.record.checkpoint import LeaseLost, checkpoint
from runs.record.eventtypes import EventType
from runs.record.runs import run_park, run_pause, run_release, run_terminate
from runs.registry import (
    Decision,
    DecisionContext,
    DecisionPostponed,
    ModelWithdrawn,
    StepView,
    Usage,
)


def advance(run_id: Any, *, worker: str) -> str:
    """Claim the run and drive it for one slice. Safe to call any number of times, from any
    number of processes: only the lease holder writes."""
    with ExitStack() as stack:
        spans: list[Any] = []

        def incarnation_begins(run: Run, recovered: bool) -> None:
            # one span per incarnation, in the run's one trace (runs/tracing.py), opened
            # after the claim's UPDATE and before its run.claimed event, which it covers
            spans.append(
                stack.enter_context(
                    tracing.incarnation_span(
                        run_id=run.id,
                        trace_id=run.trace_id,
                        fence=run.fence,
                        worker=worker,
                        recovered=recovered,
                        agent=run.agent_name,
                    )
                )
            )

        lease = claim(run_id, worker=worker, on_claimed=incarnation_begins)
        if lease is None:
            return "not_claimed"
        try:
            outcome = drive(lease)
        except LeaseLost as exc:
            log.warning("run %s: %s; stopping this incarnation", run_id, exc)
            _note_lease_lost(lease, str(exc))
            outcome = "lease_lost"
        tracing.set_outcome(spans[0] if spans else None, outcome)
        return outcome


def _note_lease_lost(lease: Lease, detail: str) -> None:
    """Say in the record that this incarnation found its lease taken (a stall past the TTL,
    a partition): an event only, unfenced, changing nothing the new holder relies on. Lease
    losses in numbers are a sign of leases too short for the work (docs/operations.md)."""
    from runs import metrics

    metrics.LEASE_LOST_IN_PROCESS.inc()
    try:
        with checkpoint(lease.run.id, actor=lease.actor, channel="worker") as cp:
            cp.event(
                EventType.RUN_LEASE_LOST, worker=lease.worker, lost_fence=lease.fence, detail=detail
            )
    except Exception:
        # only a note: failing to write it must not turn a clean stop into a crash
        log.exception("run %s: could not record the lost lease", lease.run.id)


# Set by ``runworker`` when it is asked to stop: a slice in progress then yields at its next
# step boundary instead of running out its step and time budget, so a worker stops promptly.
def _never() -> bool:
    return False


_stop_requested: Callable[[], bool] = _never


def set_stop_check(check: Callable[[], bool]) -> None:
    global _stop_requested
    _stop_requested = check


def drive(lease: Lease) -> str:
    # every log line written while this incarnation drives the run says which it is
    # (runs/logs.py): the engine's, a tool's, an HTTP client's
    with logs.bind(
        run_id=str(lease.run.id),
        incarnation=lease.fence,
        trace_id=lease.run.trace_id,
        worker=lease.worker,
    ):
        return _drive_slice(lease)


def resume_checks(lease: Lease, *, hand_off: bool = False) -> str:
    """DESIGN §5, the one resume checklist, for a worker's claim and an agent process's
    lease alike: checked on every claim, before anything new is decided. "" to go on;
    else what became of the run ("parked", or "handed_off" to a worker that serves the
    agent when ``hand_off``)."""
    if lease.agent is None:
        if hand_off and serving.hand_off(
            lease, f"agent {lease.run.agent_name!r} is not registered here"
        ):
            return "handed_off"
        park_needs_attention(
            lease,
            Run.Reason.INCOMPATIBLE_AGENT_VERSION,
            f"agent {lease.run.agent_name!r} is not registered",
        )
        return "parked"
    if not migrate_agent_version(lease):
        return "parked"
    _apply_model_policy(lease)
    # counted since an operator last retried a dead-lettered run (run_retry_recovery); a
    # hosted run's recovery is counted by the claim that takes over (``recovered``), a
    # remote run's by its lease's expiry (so every later claim checks it)
    recoveries = lease.run.recovery_count - lease.run.recovery_count_at_retry
    counted = lease.recovered or not lease.RECOVERY_COUNTED_AT_CLAIM
    if counted and recoveries > _conf("MAX_RECOVERIES"):
        park_needs_attention(
            lease,
            Run.Reason.RECOVERY_LIMIT,
            f"recovered {recoveries} times (limit {_conf('MAX_RECOVERIES')}); "
            f"{lease.run.recovery_count} in all",
        )
        return "parked"
    revoked = principal_refusal(lease, tool=None)
    if revoked:
        pause_principal_revoked(lease, revoked)
        return "parked"
    return ""


def _drive_slice(lease: Lease) -> str:
    stopped = resume_checks(lease, hand_off=True)
    if stopped:
        return stopped
    started = time.monotonic()
    advanced = 0
    while True:
        if honour_request(lease):
            return "parked"
        if advanced:
            # a long slice sees a policy, a limit or a group changed meanwhile within a second
            configcache.refresh_if_older()
        outcome = advance_once(lease)
        if outcome == Outcome.PARKED:
            return "parked"
        advanced += 1
        if (
            advanced >= _conf("SLICE_STEPS")
            or time.monotonic() - started > _conf("SLICE_SECONDS")
            or _stop_requested()
        ):
            _yield(lease)
            return "yielded"


def migrate_agent_version(lease: Lease) -> bool:
    """A run started on another version of its agent: upgrade its state through the agent's
    registered migrations (recorded), or park it for a person. False when parked."""
    run, agent = lease.run, lease.agent
    if agent.version == run.agent_version:
        return True
    path = agent.migration_path(run.agent_version)
    if path is None:
        why = f"{run.agent_name} version {run.agent_version}: this worker runs {agent.version}"
        if serving.hand_off(lease, why):
            return False
        park_needs_attention(
            lease,
            Run.Reason.INCOMPATIBLE_AGENT_VERSION,
            f"run was started on {run.agent_name} version {run.agent_version}; the registered "
            f"version is {agent.version} and no state migration leads there: fork the run "
            f"onto {agent.version} from a completed step, or terminate it",
        )
        return False
    # A migration is the agent's own code: it may fail, and then the run waits for a person
    # rather than running on a state the new code does not understand.
    state = copy.deepcopy(run.state)
    try:
        for _source, _target, migrate in path:
            state = migrate(state)
    except Exception as exc:
        park_needs_attention(
            lease,
            Run.Reason.INCOMPATIBLE_AGENT_VERSION,
            f"state migration from {run.agent_name} version {run.agent_version} to "
            f"{agent.version} failed: {_describe(exc)}",
        )
        return False
    with lease.checkpoint() as cp:
        for source, target, _migrate in path:
            cp.event(EventType.RUN_MIGRATED, **{"from": source, "to": target})
        cp.update(agent_version=agent.version, state=state, state_version=run.state_version + 1)
    run.agent_version = agent.version
    run.state = state
    run.state_version += 1
    return True


def _apply_model_policy(lease: Lease) -> None:
    """The agent's configured model changed since the run was pinned: an agent with
    ``model_policy = "follow"`` moves the run to it (``run.model_changed``); "pin" (the
    default) keeps the run on its model and records nothing — the pin is the run's own
    state, and every step.decided names the model it asked. A run not pinned yet is pinned
    at its first decision (runs/llm.py)."""
    run, agent = lease.run, lease.agent
    if getattr(agent, "model_policy", "pin") != "follow" or not run.model_id:
        return
    configured = agent.model_for_new_run()
    if not configured or configured == run.model_id:
        return
    with lease.checkpoint() as cp:
        cp.event(EventType.RUN_MODEL_CHANGED, **{"from": run.model_id, "to": configured})
        cp.update(model_id=configured)
    run.model_id = configured


def honour_request(lease: Lease) -> bool:
    run = lease.run
    if not run.requested_action:
        return False
    with lease.checkpoint() as cp:
        request = cp.run.requested_action
        if request == Run.Request.TERMINATE:
            run_terminate(cp, by=cp.run.requested_by, reason=cp.run.requested_reason)
        elif request == Run.Request.PAUSE:
            run_pause(cp, by=cp.run.requested_by, reason=cp.run.requested_reason)
        else:
            return False
    return True


def advance_once(lease: Lease) -> str:
    step = lease.open_step()
    if step is not None:
        return _continue_step(lease, step)
    exhausted = budget_exhausted(lease)
    if exhausted:
        park_needs_attention(lease, Run.Reason.BUDGET_EXHAUSTED, exhausted)
        return Outcome.PARKED
    if _reserve_decision(lease):
        return Outcome.PARKED
    # an agent that asks a remote model may take longer than half a lease: keep it renewed
    keeper = _LeaseKeeper(lease) if getattr(lease.agent, "slow_decide", False) else nullcontext()
    try:
        with keeper:
            action = lease.agent.decide(_context(lease))
    except DecisionPostponed as exc:
        # Not the agent's fault (its model API is overloaded or down): try again later
        # instead of failing the run. Budgets and the deadline still stop it.
        wake_at = lease.now() + timedelta(seconds=max(exc.retry_after, 0.0))
        with lease.checkpoint() as cp:
            cp.event(
                EventType.AGENT_POSTPONED, detail=_describe(exc), retry_in_seconds=exc.retry_after
            )
            run_release(cp, wake_at=wake_at)
        return Outcome.PARKED
    except ModelWithdrawn as exc:
        # Not the agent's fault either, and waiting will not bring the model back: a person
        # moves the run to the configured model (retry) or forks it — its work is kept.
        park_needs_attention(lease, Run.Reason.MODEL_UNAVAILABLE, _describe(exc))
        return Outcome.PARKED
    except Exception as exc:
        # The agent's own code failed: a clear, recorded failure, never a crash loop.
        finish(lease, Run.Status.FAILED, reason=Run.Reason.AGENT_FAILED, detail=_describe(exc))
        return Outcome.PARKED
    if isinstance(action, Decision):
        # recorded in the decided commit (Lease.checkpoint), whatever the action turns out to be
        lease.decision_usage = action.usage
        action = action.action
    elif lease.decision_reservation is not None:
        # a reservation is settled at what the decision says it cost: nothing, here
        lease.decision_usage = Usage()
    try:
        return _decide(lease, action)
    finally:
        lease.decision_usage = None


def _reserve_decision(lease: Lease) -> bool:
    """Before an agent asks its model (``Agent.decision_maximum``), in a commit of its own:
    requests an earlier incarnation left unsettled are charged (``spend.cut_off``), the
    run's budget is checked again with them, the spend caps that cover the run are checked
    (their counters locked), and the request's maximum is reserved — persisted before the
    request leaves, so a crash cannot make its spend disappear. True when the run stopped
    instead (``budget_exhausted``). An agent that asks no model: nothing, no query."""
    declared = getattr(lease.agent, "decision_maximum", None)
    maximum = declared(lease.run) if declared is not None else None
    if maximum is None:
        return False
    stopped = False
    with lease.checkpoint() as cp:
        spend.charge_cut_off(cp, run=lease.run, fence=lease.fence)
        exhausted = budget_exhausted(lease)
        if exhausted:
            run_park(cp, Run.Reason.BUDGET_EXHAUSTED, exhausted)
            stopped = True
        else:
            try:
                counters = spend.check(cp, run=lease.run, now=lease.now())
            except spend.CapReached as full:
                spend.stop_run(cp, run=lease.run, full=full)
                stopped = True
            else:
                reservation = spend.reserve(
                    cp,
                    run=lease.run,
                    kind=SpendReservation.Kind.MODEL,
                    cost=maximum.cost,
                    tokens=maximum.tokens,
                    fence=lease.fence,
                    counters=counters,
                )
    if not stopped:
        lease.decision_reservation = reservation
    return stopped


def _context(lease: Lease) -> DecisionContext:
    run = lease.run
    return DecisionContext(
        run_id=str(run.id),
        goal=run.goal,
        input=run.input,
        state=run.state,
        steps=tuple(_view(step) for step in lease.steps),
    )


def _view(step: Step) -> StepView:
    return transitions.step_view(step)


def budget_exhausted(lease: Lease) -> str:
    """Checked from persisted usage before every decision: a restart never resets it."""
    run = lease.run
    if run.max_steps is not None and run.steps_used >= run.max_steps:
        return f"step budget exhausted: {run.steps_used} of {run.max_steps} steps used"
    if run.max_cost is not None and run.cost_used >= run.max_cost:
        return f"cost budget exhausted: {run.cost_used} of {run.max_cost}"
    if run.max_tokens is not None and run.tokens_used >= run.max_tokens:
        return f"token budget exhausted: {run.tokens_used} of {run.max_tokens}"
    if run.deadline is not None and lease.now() >= run.deadline:
        return f"deadline {run.deadline.isoformat()} has passed"
    return ""

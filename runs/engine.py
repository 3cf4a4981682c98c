"""The durable run engine (DESIGN §3–§5).

One call to ``advance(run_id, worker=...)`` claims the run's lease and drives it for a slice
of steps. Everything it does is re-derived from the record: the open step, its tool call's
status, the receipt. Every write goes through ``checkpoint(fence=...)``; a write that matches
no row (the fence moved on) raises ``LeaseLost`` and this process stops at once.

Never is a transaction or row lock held across a tool call, a lookup or an agent decision.
"""

from __future__ import annotations

import copy
import json
import logging
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager, nullcontext
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from django.conf import settings
from django.db import connection, transaction
from django.db.models import F, Q
from django.db.models.functions import Now
from django.utils import timezone

from runs import fastsql, logs, services, tracing, transitions, waits
from runs.events import (
    LIVE_FIELDS,
    Checkpoint,
    LeaseLost,
    checkpoint,
    lease_expiry_expression,
)
from runs.gate import GateRefused, gate_installed, get_gate
from runs.models import AgentManifest, Run, Step, ToolCall, ToolReceipt
from runs.queue import enqueue_on_commit
from runs.registry import (
    Agent,
    AskQuestion,
    CallTool,
    Decision,
    DecisionContext,
    DecisionPostponed,
    Effect,
    Fail,
    Finish,
    LookupResult,
    OutcomeUnknown,
    Sleep,
    StepView,
    Tool,
    ToolContext,
    ToolFailed,
    ToolResult,
    UnknownAgent,
    UnknownTool,
    Usage,
    WaitForSignal,
    digest,
    registry,
)

log = logging.getLogger(__name__)


def _conf(name: str) -> Any:
    return settings.AGENTOPS[name]


@dataclass
class Lease:
    """What this incarnation knows while it holds a run's lease."""

    run: Run
    fence: int
    worker: str
    recovered: bool
    agent: Agent
    steps: list[Step]
    claimed_db_time: datetime
    claimed_monotonic: float = field(default_factory=time.monotonic)
    # what the decision being recorded cost (an LLM agent's tokens): written with it
    decision_usage: Usage | None = None

    @property
    def actor(self) -> str:
        return f"worker:{self.worker}"

    def now(self) -> datetime:
        """Database time, derived from the clock read at claim (no query per step)."""
        return self.claimed_db_time + timedelta(seconds=time.monotonic() - self.claimed_monotonic)

    @contextmanager
    def checkpoint(
        self, *, locked: Run | None = None, optimistic: bool = False
    ) -> Iterator[Checkpoint]:
        """``optimistic``: the body only records (``cp.event/update/insert/update_row``) what
        this incarnation did, whatever others write meanwhile: written without locking the
        run first (``events.checkpoint(expect=...)``)."""
        with checkpoint(
            self.run.id,
            actor=self.actor,
            channel="worker",
            fence=self.fence,
            locked=locked,
            expect=self.run if optimistic else None,
        ) as cp:
            yield cp
            if self.decision_usage is not None and "decided" in cp.boundaries:
                _record_decision_usage(cp, self, self.decision_usage)
        if cp.boundaries:
            log.info(
                "checkpoint %s committed",
                "+".join(cp.boundaries),
                extra={
                    "run_id": str(self.run.id),
                    "incarnation": self.fence,
                    "trace_id": self.run.trace_id,
                    "worker": self.worker,
                    "boundary": "+".join(cp.boundaries),
                },
            )
        if cp.run is not self.run:
            # where the record ends: the next optimistic checkpoint expects it
            self.run.event_seq = cp.run.event_seq
            self.run.last_event_hash = cp.run.last_event_hash
        self.take_operator_changes(cp.run)

    def take_operator_changes(self, locked: Run) -> None:
        """What others may change under a live lease, as the checkpoint read it back: an
        operator's request (honoured at the loop's next turn) and budget limits (an
        operator may raise them)."""
        if locked is not self.run:
            for name in LIVE_FIELDS:
                setattr(self.run, name, getattr(locked, name))

    def open_step(self) -> Step | None:
        if self.steps and self.steps[-1].status == Step.Status.PENDING:
            return self.steps[-1]
        return None


class Outcome:
    CONTINUE = "continue"
    PARKED = "parked"  # lease released: waiting, needs attention, finished, yielded


# --- claim -----------------------------------------------------------------------------------


def _kind_filter(remote: bool) -> Q:
    """Remote agents' runs are advanced only by agent processes through the API
    (``runs.remote``), hosted ones only by workers: neither may claim the other's."""
    remote_names = Q(agent_name__in=AgentManifest.objects.values("name"))
    return remote_names if remote else ~remote_names


def claim(
    run_id: Any,
    *,
    worker: str,
    remote: bool = False,
    lease_type: type[Lease] = Lease,
    on_claimed: Callable[[Run, bool], None] | None = None,
) -> Lease | None:
    """Take the lease with one compare-and-set UPDATE in database time. Returns None when the
    run is not runnable or someone else holds a live lease (a duplicate wake-up)."""
    with transaction.atomic():
        taken = (_take_lease_sql if connection.vendor == "postgresql" else _take_lease_orm)(
            run_id, worker=worker, remote=remote
        )
        if taken is None:
            return None
        run, recovered, claimed_db_time = taken
        if on_claimed is not None:
            on_claimed(run, recovered)
        try:
            agent = registry.agent(run.agent_name)
        except UnknownAgent:
            agent = None
        lease = lease_type(
            run=run,
            fence=run.fence,
            worker=worker,
            recovered=recovered,
            agent=agent,  # type: ignore[arg-type]
            steps=list(Step.objects.filter(run_id=run_id).order_by("seq")),
            claimed_db_time=claimed_db_time,
        )
        with lease.checkpoint(locked=run) as cp:
            cp.event(
                "run.claimed",
                worker=worker,
                fence=run.fence,
                recovered=recovered,
                recovery_count=run.recovery_count,
            )
            cp.boundary("claimed")
    return lease


def _take_lease_orm(run_id: Any, *, worker: str, remote: bool) -> tuple[Run, bool, datetime] | None:
    """The claim's compare-and-set through the ORM (SQLite): read the fence, then UPDATE
    on it. Returns the run as updated, whether it was recovered, and the database's time."""
    # runnable, or waiting with its timer or timeout due (docs/waits.md)
    observed = (
        Run.objects.filter(waits.claimable(), _kind_filter(remote), id=run_id)
        .values_list("fence", "status")
        .first()
    )
    if observed is None:
        return None
    fence, status = observed
    recovered = status == Run.Status.RUNNING  # its last holder never released it
    taken = (
        Run.objects.filter(waits.claimable(), _kind_filter(remote), id=run_id, fence=fence)
        .filter(Q(lease_expires_at__isnull=True) | Q(lease_expires_at__lt=Now()))
        .filter(Q(wake_at__isnull=True) | Q(wake_at__lte=Now()))
        .update(
            fence=F("fence") + 1,
            lease_owner=worker,
            lease_expires_at=lease_expiry_expression(),
            status=Run.Status.RUNNING,
            recovery_count=F("recovery_count") + (1 if recovered else 0),
            wake_at=None,
            enqueued_at=None,
        )
    )
    if taken != 1:
        return None
    # the row the UPDATE above locked, and the database's clock, in one query
    run = Run.objects.annotate(db_time_at_claim=Now()).get(id=run_id)
    return run, recovered, run.db_time_at_claim


_claim_sql: dict[bool, tuple[str, list[Any]]] = {}


def _take_lease_sql(run_id: Any, *, worker: str, remote: bool) -> tuple[Run, bool, datetime] | None:
    """The same compare-and-set on PostgreSQL as ONE statement (docs/benchmarks.md: built
    through the ORM, the claim's three queries cost more CPU than a whole step). The
    subquery locks the row and reads the status it had — ``running`` means its last holder
    never released it (recovered) — and the UPDATE applies the ORM path's conditions to that
    same, locked row; RETURNING gives the row as updated and the database's time."""
    if remote not in _claim_sql:
        quote = connection.ops.quote_name
        meta = Run._meta

        def col(name: str) -> str:
            return quote(meta.get_field(name).column)

        fields = meta.concrete_fields
        table, manifests = quote(meta.db_table), quote(AgentManifest._meta.db_table)
        runnable = ", ".join(["%s"] * len(Run.RUNNABLE))
        now = "STATEMENT_TIMESTAMP()"
        sql = (
            f"UPDATE {table} AS r SET {col('fence')} = r.{col('fence')} + 1, "
            f"{col('lease_owner')} = %s, "
            f"{col('lease_expires_at')} = {now} + make_interval(secs => %s), "
            f"{col('status')} = %s, "
            f"{col('recovery_count')} = r.{col('recovery_count')} "
            f"+ CASE WHEN old.{col('status')} = %s THEN 1 ELSE 0 END, "
            f"{col('wake_at')} = NULL, {col('enqueued_at')} = NULL "
            f"FROM (SELECT {col('id')}, {col('status')} FROM {table} "
            f"WHERE {col('id')} = %s FOR UPDATE) AS old "
            f"WHERE r.{col('id')} = old.{col('id')} "
            f"AND (r.{col('status')} IN ({runnable}) OR (r.{col('status')} = %s "
            f"AND r.{col('wake_at')} IS NOT NULL AND r.{col('wake_at')} <= {now})) "
            f"AND {'' if remote else 'NOT '}(r.{col('agent_name')} IN "
            f"(SELECT {quote(AgentManifest._meta.get_field('name').column)} FROM {manifests})) "
            f"AND (r.{col('lease_expires_at')} IS NULL OR r.{col('lease_expires_at')} < {now}) "
            f"AND (r.{col('wake_at')} IS NULL OR r.{col('wake_at')} <= {now}) "
            f"RETURNING old.{col('status')}, {now}, "
            + ", ".join(f"r.{quote(f.column)}" for f in fields)
        )
        _claim_sql[remote] = (
            sql,
            [(f.attname, f.get_db_converters(connection), f) for f in fields],
        )
    sql, columns = _claim_sql[remote]
    params = [
        worker,
        float(_conf("LEASE_TTL")),
        Run.Status.RUNNING.value,
        Run.Status.RUNNING.value,
        run_id,
        *[status.value for status in Run.RUNNABLE],
        Run.Status.WAITING_EVENT.value,
    ]
    with connection.cursor() as cursor:
        cursor.execute(sql, params)
        row = cursor.fetchone()
    if row is None:
        return None
    old_status, db_time, *values = row
    for index, (_attname, converters, model_field) in enumerate(columns):
        for converter in converters:
            values[index] = converter(values[index], model_field, connection)
    run = Run.from_db(connection.alias, [attname for attname, _c, _f in columns], values)
    return run, old_status == Run.Status.RUNNING, db_time


# --- the loop --------------------------------------------------------------------------------


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
            outcome = _drive(lease)
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
            cp.event("run.lease_lost", worker=lease.worker, lost_fence=lease.fence, detail=detail)
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


def _drive(lease: Lease) -> str:
    # every log line written while this incarnation drives the run says which it is
    # (runs/logs.py): the engine's, a tool's, an HTTP client's
    with logs.bind(
        run_id=str(lease.run.id),
        incarnation=lease.fence,
        trace_id=lease.run.trace_id,
        worker=lease.worker,
    ):
        return _drive_slice(lease)


def _drive_slice(lease: Lease) -> str:
    if lease.agent is None:
        _park_needs_attention(
            lease,
            Run.Reason.INCOMPATIBLE_AGENT_VERSION,
            f"agent {lease.run.agent_name!r} is not registered",
        )
        return "parked"
    # DESIGN §5: everything below is checked on every claim, before anything new is decided
    if not _migrate_agent_version(lease):
        return "parked"
    _apply_model_policy(lease)
    # counted since an operator last retried a dead-lettered run (run_retry_recovery)
    recoveries = lease.run.recovery_count - lease.run.recovery_count_at_retry
    if lease.recovered and recoveries > _conf("MAX_RECOVERIES"):
        _park_needs_attention(
            lease,
            Run.Reason.RECOVERY_LIMIT,
            f"recovered {recoveries} times (limit {_conf('MAX_RECOVERIES')}); "
            f"{lease.run.recovery_count} in all",
        )
        return "parked"
    revoked = _principal_refusal(lease, tool=None)
    if revoked:
        _pause_principal_revoked(lease, revoked)
        return "parked"
    started = time.monotonic()
    advanced = 0
    while True:
        if _honour_request(lease):
            return "parked"
        outcome = _advance_once(lease)
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


def _migrate_agent_version(lease: Lease) -> bool:
    """A run started on another version of its agent: upgrade its state through the agent's
    registered migrations (recorded), or park it for a person. False when parked."""
    run, agent = lease.run, lease.agent
    if agent.version == run.agent_version:
        return True
    path = agent.migration_path(run.agent_version)
    if path is None:
        _park_needs_attention(
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
        _park_needs_attention(
            lease,
            Run.Reason.INCOMPATIBLE_AGENT_VERSION,
            f"state migration from {run.agent_name} version {run.agent_version} to "
            f"{agent.version} failed: {_describe(exc)}",
        )
        return False
    with lease.checkpoint() as cp:
        for source, target, _migrate in path:
            cp.event("run.migrated", **{"from": source, "to": target})
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
        cp.event("run.model_changed", **{"from": run.model_id, "to": configured})
        cp.update(model_id=configured)
    run.model_id = configured


def _principal_refusal(lease: Lease, tool: Tool | None) -> str:
    """Why the run's principal may not act now (deactivated, or not in a group ``tool``
    allows); empty when it may. Runs without a principal act as the system."""
    run = lease.run
    if run.principal_id is None:
        return ""
    principal = run.principal  # loaded once per claim: a change is seen at the next claim
    if not principal.is_active:
        return f"principal {principal.get_username()} is deactivated"
    allowed = (
        tool is None
        or not tool.allowed_groups
        or principal.is_superuser
        or principal.groups.filter(name__in=tool.allowed_groups).exists()
    )
    if not allowed:
        return (
            f"principal {principal.get_username()} is in none of the groups "
            f"{', '.join(tool.allowed_groups)} that may use {tool.name}"
        )
    return ""


def _pause_principal_revoked_in(cp, detail: str) -> None:
    # paused, not failed: once the principal is fixed an operator resumes the run
    cp.event("run.paused", by="system", reason=Run.Reason.PRINCIPAL_REVOKED, detail=detail)
    cp.update(
        status=Run.Status.PAUSED,
        reason_code=Run.Reason.PRINCIPAL_REVOKED,
        reason_detail=detail,
        lease_owner="",
        lease_expires_at=None,
    )


def _pause_principal_revoked(lease: Lease, detail: str) -> None:
    with lease.checkpoint() as cp:
        _pause_principal_revoked_in(cp, detail)


def _honour_request(lease: Lease) -> bool:
    run = lease.run
    if not run.requested_action:
        return False
    with lease.checkpoint() as cp:
        request = cp.run.requested_action
        if request == Run.Request.TERMINATE:
            services.apply_terminate(cp, by=cp.run.requested_by, reason=cp.run.requested_reason)
        elif request == Run.Request.PAUSE:
            services.apply_pause(cp, by=cp.run.requested_by, reason=cp.run.requested_reason)
        else:
            return False
    return True


def _advance_once(lease: Lease) -> str:
    step = lease.open_step()
    if step is not None:
        return _continue_step(lease, step)
    exhausted = _budget_exhausted(lease)
    if exhausted:
        _park_needs_attention(lease, Run.Reason.BUDGET_EXHAUSTED, exhausted)
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
            cp.event("agent.postponed", detail=_describe(exc), retry_in_seconds=exc.retry_after)
            _release_in(cp, wake_at=wake_at)
        return Outcome.PARKED
    except Exception as exc:
        # The agent's own code failed: a clear, recorded failure, never a crash loop.
        _finish(lease, Run.Status.FAILED, reason=Run.Reason.AGENT_FAILED, detail=_describe(exc))
        return Outcome.PARKED
    if isinstance(action, Decision):
        # recorded in the decided commit (Lease.checkpoint), whatever the action turns out to be
        action, lease.decision_usage = action.action, action.usage
    try:
        return _decide(lease, action)
    finally:
        lease.decision_usage = None


def _record_decision_usage(cp: Checkpoint, lease: Lease, usage: Usage) -> None:
    """Inside the ``decided`` commit: the step that commit creates carries the decision's
    tokens and cost, the run's persisted usage grows by them, and ``step.decided`` says so."""
    seq = max(
        (event.payload.get("seq", 0) for event in cp.events if event.type == "step.decided"),
        default=None,
    )
    if seq is None:
        return
    Step.objects.filter(run_id=lease.run.id, seq=seq).update(tokens=usage.tokens, cost=usage.cost)
    cp.update(tokens_used=F("tokens_used") + usage.tokens, cost_used=F("cost_used") + usage.cost)
    for event in cp.events:
        if event.type == "step.decided":
            event.payload["usage"] = json.loads(
                json.dumps(
                    {"tokens": usage.tokens, "cost": usage.cost, **usage.detail}, default=str
                )
            )
            if usage.answers:
                # what the model said, for manage.py replay (masked by the agent)
                event.payload["answers"] = json.loads(json.dumps(usage.answers, default=str))
    lease.run.tokens_used += usage.tokens
    lease.run.cost_used += usage.cost
    lease.decision_usage = None


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


def _budget_exhausted(lease: Lease) -> str:
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


def _describe(exc: BaseException) -> str:
    return "".join(traceback.format_exception_only(type(exc), exc)).strip()[:2000]


# --- deciding --------------------------------------------------------------------------------


def _decide(lease: Lease, action: Any) -> str:
    seq = (lease.steps[-1].seq + 1) if lease.steps else 1
    if isinstance(action, Finish):
        _finish(lease, Run.Status.SUCCEEDED, result=action.result, seq=seq)
        return Outcome.PARKED
    if isinstance(action, Fail):
        _finish(
            lease, Run.Status.FAILED, reason=Run.Reason.AGENT_FAILED, detail=action.reason, seq=seq
        )
        return Outcome.PARKED
    if isinstance(action, CallTool):
        return _decide_call(lease, action, seq)
    if isinstance(action, WaitForSignal | Sleep | AskQuestion):
        return _decide_wait(lease, action, seq)
    _finish(
        lease,
        Run.Status.FAILED,
        reason=Run.Reason.AGENT_FAILED,
        detail=f"decide() returned {type(action).__name__}, not an action",
    )
    return Outcome.PARKED


def _rejected_call(lease: Lease, action: CallTool, seq: int, error: str) -> str:
    """A call the engine refuses before anything happens (unknown tool, bad arguments):
    recorded as a failed step the agent sees, never dispatched."""
    with lease.checkpoint() as cp:
        step = Step.objects.create(
            run_id=lease.run.id,
            seq=seq,
            kind=Step.Kind.TOOL_CALL,
            status=Step.Status.FAILED,
            input={"tool": action.tool, "arguments": "(not recorded: invalid call)"},
            error=error,
            incarnation=lease.fence,
            completed_at=timezone.now(),
        )
        cp.event("step.decided", seq=seq, kind=step.kind, tool=action.tool, refused=error)
        cp.update(steps_used=F("steps_used") + 1)
        cp.boundary("decided")
    lease.run.steps_used += 1
    lease.steps.append(step)
    return Outcome.CONTINUE


def _decide_call(lease: Lease, action: CallTool, seq: int, *, execute: bool = True) -> str:
    """``execute=False`` (remote agents): the call is recorded and left ``proposed`` for the
    agent process to dispatch (``runs.remote``) instead of being called here."""
    run = lease.run
    if action.tool not in lease.agent.tools:
        return _rejected_call(
            lease, action, seq, f"agent {run.agent_name} may not use tool {action.tool!r}"
        )
    try:
        tool = registry.tool(action.tool)
    except UnknownTool as exc:
        return _rejected_call(lease, action, seq, str(exc))
    arguments = dict(action.arguments)
    errors = tool.validate(arguments)
    if errors:
        return _rejected_call(
            lease, action, seq, "arguments do not match the schema: " + "; ".join(errors)
        )
    fingerprint = tool.precondition(arguments) if tool.precondition else ""
    needs_approval = tool.approval.requires_approval(arguments)
    if needs_approval and not gate_installed():
        return _rejected_call(
            lease, action, seq, "the call needs approval and no gate is installed"
        )
    masked = tool.mask(arguments)
    revoked = _principal_refusal(lease, tool)
    root_id = run.root_run_id or run.id
    idempotency_key = f"{root_id}:{seq}"
    sibling = None
    if root_id != run.id:
        # A fork: its family may already have used this key (DESIGN §5.2, docs/recovery.md).
        sibling = _family_call(run, idempotency_key)
        if sibling is not None and (
            sibling.tool_name != tool.name or sibling.arguments_digest != digest(arguments)
        ):
            # a different call at the same seq: sharing the key would make an idempotent
            # system answer with the other call's result, so this branch starts its own key
            idempotency_key, sibling = f"{run.id}:{seq}", None
    if sibling is not None and not revoked:
        return _decide_family_call(
            lease, seq, tool, arguments, masked, fingerprint, sibling, execute=execute
        )

    step = Step(
        run_id=run.id,
        seq=seq,
        kind=Step.Kind.TOOL_CALL,
        input={"tool": tool.name, "arguments": masked},
        incarnation=lease.fence,
    )
    call = ToolCall(
        run_id=run.id,
        tool_name=tool.name,
        tool_version=tool.version,
        effect=str(tool.effect),
        arguments=arguments,
        arguments_masked=masked,
        arguments_digest=digest(arguments),
        idempotency_key=idempotency_key,
        precondition_fingerprint=fingerprint,
    )
    if (
        execute
        and not revoked
        and not needs_approval
        and tool.effect == Effect.READ
        and lease.decision_usage is None
        and tool.timeout <= _conf("LEASE_TTL") / 2
    ):
        return _read_in_one_commit(lease, step, call, tool)

    # a call dispatched now: its step and row go with the events in the commit's one
    # statement (a decision that cost tokens updates its step in the checkpoint's body, so
    # that step is inserted at once); a hosted agent's such commit only records
    at_commit = not (revoked or needs_approval) and lease.decision_usage is None
    with lease.checkpoint(optimistic=at_commit and execute) as cp:
        _record_decided(cp, lease, step, call, at_commit=at_commit)
        if revoked:
            # the decision is kept (the agent is not asked again); it is dispatched, or sent
            # for approval, when the run is resumed with a principal allowed to use the tool
            call.save(force_insert=True)
            _pause_principal_revoked_in(cp, revoked)
        elif needs_approval:
            # decided + approval_requested share this commit: no external call between them
            call.status = ToolCall.Status.AWAITING_APPROVAL
            call.save(force_insert=True)
            get_gate().request(cp=cp, run=run, call=call, tool=tool)
            cp.event("run.waiting", on="approval", seq=seq, tool=tool.name)
            cp.update(status=Run.Status.WAITING_APPROVAL, lease_owner="", lease_expires_at=None)
            cp.boundary("approval_requested")
        else:
            # decided + dispatching share this commit: both come before the side effect
            if execute:
                _mark_dispatching(cp, call, lease)
            if at_commit:
                cp.insert(call)
            else:
                fastsql.insert(call)
    run.steps_used += 1
    lease.steps.append(step)
    if revoked or needs_approval:
        return Outcome.PARKED
    if not execute:
        return Outcome.CONTINUE
    return _execute(lease, step, call, tool)


def _record_decided(
    cp: Checkpoint, lease: Lease, step: Step, call: ToolCall, *, at_commit: bool = False
) -> None:
    """``decided`` for a tool call: its step (inserted here, or with ``at_commit`` in the
    checkpoint's one statement) and the call's events. The call itself is inserted by the
    caller once its status is known."""
    if at_commit:
        cp.insert(step)
    else:
        fastsql.insert(step)
    call.step = step
    cp.event(
        "step.decided",
        seq=step.seq,
        kind=step.kind,
        tool=call.tool_name,
        tool_version=call.tool_version,
        arguments=call.arguments_masked,
        idempotency_key=call.idempotency_key,
    )
    cp.update(steps_used=F("steps_used") + 1)
    cp.boundary("decided")


def _read_in_one_commit(lease: Lease, step: Step, call: ToolCall, tool: Tool) -> str:
    """A ``read`` call whose decision cost nothing (no model tokens): called first, then
    ``decided`` + ``dispatching`` + ``receipt_recorded`` + ``step_completed`` in ONE commit.

    A read has no side effect, so nothing happens outside between the decision and the
    outcome that a record of the decision alone would protect: a crash before the commit
    loses a free decision and a read, and the next incarnation simply makes both again
    (docs/recovery.md). This is the guarantee of a DBOS step, at one commit per step. A
    decision that cost tokens is recorded before the call (the two-commit path), so that
    it is never paid for twice; so is a slow read (one that may outlast half a lease)."""
    dispatched_at = lease.now()
    ok, result, error = _call_tool(lease, call, tool, attempt=1)
    if ok is None:
        # the read raised something unexpected: record the decision and the dispatch as the
        # two-commit path would have, then handle the unknown outcome the ordinary way
        with lease.checkpoint() as cp:
            _record_decided(cp, lease, step, call)
            _mark_dispatching(cp, call, lease)
            fastsql.insert(call)
        lease.run.steps_used += 1
        lease.steps.append(step)
        _mark_unknown(lease, call, error)
        return _reconcile(lease, step, call, tool)
    output = result.result if result else None
    with lease.checkpoint(optimistic=True) as cp:
        step.status = Step.Status.COMPLETED if ok else Step.Status.FAILED
        step.output = output
        step.error = error
        step.completed_at = timezone.now()
        # step, call and receipt: inserted with the events and the run's update (one
        # statement on PostgreSQL)
        _record_decided(cp, lease, step, call, at_commit=True)
        _mark_dispatching(cp, call, lease)
        call.dispatched_at = dispatched_at
        call.status = ToolCall.Status.SUCCEEDED if ok else ToolCall.Status.FAILED
        cp.insert(call)
        _record_receipt(
            cp,
            lease,
            call,
            ok=ok,
            result=output if ok else {"error": error},
            external_ref=result.external_ref if result else "",
            source=ToolReceipt.Source.TOOL,
            later=True,
        )
        transitions.apply_to_state(cp, run=lease.run, agent=lease.agent, step=step)
    lease.run.steps_used += 1
    lease.steps.append(step)
    return Outcome.CONTINUE


def _decide_wait(lease: Lease, action: WaitForSignal | Sleep | AskQuestion, seq: int) -> str:
    """``decided`` + ``run.waiting`` in one commit: the wait step, its question, and the run
    parked in ``waiting_event`` with no lease. A signal that arrived before the wait began
    (or a timer already due) ends it in this same commit: services lock the same run row,
    so a signal is either seen here or finds the run waiting and wakes it."""
    error = waits.validate(action)
    if error:
        with lease.checkpoint() as cp:
            step = Step.objects.create(
                run_id=lease.run.id,
                seq=seq,
                kind=Step.Kind.WAIT,
                status=Step.Status.FAILED,
                input={"wait": type(action).__name__, "refused": True},
                error=error,
                incarnation=lease.fence,
                completed_at=timezone.now(),
            )
            cp.event("step.decided", seq=seq, kind=step.kind, refused=error)
            cp.update(steps_used=F("steps_used") + 1)
            cp.boundary("decided")
        lease.run.steps_used += 1
        lease.steps.append(step)
        return Outcome.CONTINUE
    spec, _wake_at = waits.spec(action, lease.now())
    with lease.checkpoint() as cp:
        step = Step.objects.create(
            run_id=lease.run.id, seq=seq, kind=Step.Kind.WAIT, input=spec, incarnation=lease.fence
        )
        cp.event("step.decided", seq=seq, kind=step.kind, wait=spec)
        cp.update(steps_used=F("steps_used") + 1)
        cp.boundary("decided")
        if isinstance(action, AskQuestion):
            waits.question_create(cp, step=step)
        ended = waits.end_wait_if_due(
            cp, run=lease.run, agent=lease.agent, step=step, now=lease.now()
        )
        if not ended:
            waits.park(cp, step=step)
    lease.run.steps_used += 1
    lease.steps.append(step)
    return Outcome.CONTINUE if ended else Outcome.PARKED


def _continue_wait(lease: Lease, step: Step) -> str:
    """An open wait found at claim: woken by a signal or an answer, by its timer or timeout,
    or by a recovery. What ends it is read from the record; if nothing does yet, the run
    parks again (a duplicate wake-up costs one commit, never a lost wait)."""
    with lease.checkpoint() as cp:
        ended = waits.end_wait_if_due(
            cp, run=lease.run, agent=lease.agent, step=step, now=lease.now()
        )
        if not ended:
            waits.park(cp, step=step, again=True)
    return Outcome.CONTINUE if ended else Outcome.PARKED


def _family_call(run: Run, idempotency_key: str) -> ToolCall | None:
    """The call another run of this fork's family made under this key: the one with a
    receipt first, then one that was dispatched."""
    calls = list(
        ToolCall.objects.filter(idempotency_key=idempotency_key)
        .exclude(run_id=run.id)
        .select_related("receipt")
    )
    calls.sort(key=lambda c: (not hasattr(c, "receipt"), c.attempt_count == 0))
    return calls[0] if calls else None


def _decide_family_call(
    lease: Lease,
    seq: int,
    tool: Tool,
    arguments: dict[str, Any],
    masked: dict[str, Any],
    fingerprint: str,
    sibling: ToolCall,
    *,
    execute: bool = True,
) -> str:
    """A fork decided the very call its family already made under this key. Its effect is
    never repeated blindly: a succeeded receipt is adopted; a dispatch without a receipt is
    an unknown outcome, reconciled by key like any other; a call never dispatched is simply
    made (with the same key)."""
    run = lease.run
    receipt = getattr(sibling, "receipt", None)
    adopt = receipt is not None and receipt.outcome == ToolReceipt.Outcome.SUCCEEDED
    in_doubt = not adopt and receipt is None and sibling.attempt_count > 0
    needs_approval = tool.approval.requires_approval(arguments)
    with lease.checkpoint() as cp:
        step = Step.objects.create(
            run_id=run.id,
            seq=seq,
            kind=Step.Kind.TOOL_CALL,
            input={"tool": tool.name, "arguments": masked},
            incarnation=lease.fence,
        )
        call = ToolCall(
            step=step,
            run_id=run.id,
            tool_name=tool.name,
            tool_version=tool.version,
            effect=str(tool.effect),
            arguments=arguments,
            arguments_masked=masked,
            arguments_digest=digest(arguments),
            idempotency_key=sibling.idempotency_key,
            precondition_fingerprint=fingerprint,
        )
        cp.event(
            "step.decided",
            seq=seq,
            kind=step.kind,
            tool=tool.name,
            tool_version=tool.version,
            arguments=masked,
            idempotency_key=call.idempotency_key,
            family_call={"run": sibling.run_id, "status": sibling.status},
        )
        cp.update(steps_used=F("steps_used") + 1)
        cp.boundary("decided")
        if adopt:
            call.save(force_insert=True)
            transitions.record_receipt(
                cp,
                call,
                ok=True,
                result=receipt.result,
                external_ref=receipt.external_ref,
                source=ToolReceipt.Source.RECONCILIATION,
                recorded_by=lease.actor,
                incarnation=lease.fence,
            )
            _complete_step(cp, lease, step, call, True, receipt.result, "")
        elif in_doubt:
            call.status = ToolCall.Status.UNKNOWN
            call.dispatched_at = sibling.dispatched_at
            call.last_error = (
                f"key {call.idempotency_key} was dispatched by run {sibling.run_id} "
                f"({sibling.status}) with no receipt"
            )
            call.save(force_insert=True)
            cp.event(
                "tool.unknown",
                seq=seq,
                tool=tool.name,
                attempt=0,
                idempotency_key=call.idempotency_key,
                error=call.last_error,
            )
        elif needs_approval:
            call.status = ToolCall.Status.AWAITING_APPROVAL
            call.save(force_insert=True)
            get_gate().request(cp=cp, run=run, call=call, tool=tool)
            cp.event("run.waiting", on="approval", seq=seq, tool=tool.name)
            cp.update(status=Run.Status.WAITING_APPROVAL, lease_owner="", lease_expires_at=None)
            cp.boundary("approval_requested")
        else:
            if execute:
                _mark_dispatching(cp, call, lease)
            fastsql.insert(call)
    run.steps_used += 1
    lease.steps.append(step)
    if adopt:
        return Outcome.CONTINUE
    if not execute:
        # remote agents reconcile an in-doubt family call themselves (it is ``unknown``)
        return Outcome.PARKED if needs_approval and not in_doubt else Outcome.CONTINUE
    if in_doubt:
        return _reconcile(lease, step, call, tool)
    if needs_approval:
        return Outcome.PARKED
    return _execute(lease, step, call, tool)


def _mark_dispatching(cp, call: ToolCall, lease: Lease) -> None:
    call.status = ToolCall.Status.DISPATCHING
    call.attempt_count += 1
    # database time: compared with database time when deciding whether it can still land
    call.dispatched_at = lease.now()
    call.dispatch_incarnation = lease.fence
    cp.event(
        "tool.dispatching",
        seq=call.step.seq,
        tool=call.tool_name,
        attempt=call.attempt_count,
        idempotency_key=call.idempotency_key,
    )
    cp.boundary("dispatching")


# --- continuing an open step ----------------------------------------------------------------


def _continue_step(lease: Lease, step: Step) -> str:
    if step.kind == Step.Kind.WAIT:
        return _continue_wait(lease, step)
    if step.kind != Step.Kind.TOOL_CALL:
        _fail_step(lease, step, f"cannot continue a {step.kind} step")
        return Outcome.CONTINUE
    call = ToolCall.objects.select_related("step").get(step=step)
    try:
        tool = registry.tool(call.tool_name)
    except UnknownTool:
        tool = None
    if tool is None or tool.version != call.tool_version:
        return _tool_changed(lease, step, call, tool)

    status = call.status
    if status in (ToolCall.Status.PROPOSED, ToolCall.Status.APPROVED):
        return _dispatch(lease, step, call, tool)
    if status == ToolCall.Status.AWAITING_APPROVAL:
        _release(lease, status=Run.Status.WAITING_APPROVAL)
        return Outcome.PARKED
    if status == ToolCall.Status.REJECTED:
        _fail_step(lease, step, f"approval rejected: {call.last_error}".rstrip(": "))
        return Outcome.CONTINUE
    if status == ToolCall.Status.CANCELLED:
        _fail_step(lease, step, "tool call cancelled")
        return Outcome.CONTINUE
    if status == ToolCall.Status.DISPATCHING:
        # Left in flight by an earlier incarnation: nobody knows whether it took effect.
        _mark_unknown(
            lease, call, f"left in dispatching by incarnation {call.dispatch_incarnation}"
        )
        return _reconcile(lease, step, call, tool, interrupted=True)
    if status == ToolCall.Status.UNKNOWN and call.redispatch_authorized:
        # An operator chose "dispatch again" (toolcall_resolve). Their call, not a lookup's,
        # but the original request must still be unable to land before it is sent again.
        can_land_until = _can_land_until(lease, call, tool)
        if tool.effect not in (Effect.READ, Effect.IDEMPOTENT) and lease.now() < can_land_until:
            _release(lease, wake_at=can_land_until)
            return Outcome.PARKED
        return _dispatch(lease, step, call, tool)
    if status == ToolCall.Status.UNKNOWN:
        return _reconcile(lease, step, call, tool)
    # succeeded / failed with a receipt but the step still open
    receipt = ToolReceipt.objects.get(tool_call=call)
    with lease.checkpoint() as cp:
        _complete_step(
            cp,
            lease,
            step,
            call,
            receipt.outcome == ToolReceipt.Outcome.SUCCEEDED,
            receipt.result,
            "",
        )
    return Outcome.CONTINUE


def _tool_changed(lease: Lease, step: Step, call: ToolCall, tool: Tool | None) -> str:
    """The call's tool is gone or changed since it was decided (DESIGN §5.2). A call that
    was never dispatched is cancelled; one in flight keeps its unknown outcome for a person."""
    detail = (
        f"tool {call.tool_name!r} is no longer registered"
        if tool is None
        else f"tool {call.tool_name!r} changed from version {call.tool_version} to {tool.version}"
    )
    if call.status in (ToolCall.Status.DISPATCHING, ToolCall.Status.UNKNOWN):
        if call.status == ToolCall.Status.DISPATCHING:
            _mark_unknown(lease, call, "left in dispatching; " + detail)
        _park_needs_attention(lease, Run.Reason.TOOL_RETIRED, detail + "; its outcome is unknown")
        return Outcome.PARKED
    undispatched = (
        ToolCall.Status.PROPOSED,
        ToolCall.Status.AWAITING_APPROVAL,
        ToolCall.Status.APPROVED,
    )
    if tool is not None and call.status in undispatched and call.attempt_count == 0:
        errors = tool.validate(call.arguments)
        if not errors:
            return _rebind_to_tool_version(lease, step, call, tool)
        detail += "; the call's arguments do not match it: " + "; ".join(errors)
    with lease.checkpoint() as cp:
        if call.status in ToolCall.OPEN:
            get_gate().cancel(cp=cp, call=call, reason="tool_retired")
            ToolCall.objects.filter(id=call.id).update(
                status=ToolCall.Status.CANCELLED, updated_at=timezone.now()
            )
            cp.event(
                "tool.cancelled",
                seq=step.seq,
                tool=call.tool_name,
                reason="tool_retired",
                detail=detail,
            )
        _fail_step_in(cp, lease, step, f"tool_retired: {detail}")
    return Outcome.CONTINUE


def _rebind_to_tool_version(lease: Lease, step: Step, call: ToolCall, tool: Tool) -> str:
    """A call not yet dispatched whose tool changed version: an approval given for the old
    version is not valid for the new one (the approver approved another tool), so it is
    cancelled and, if the new version's policy asks for one, requested again."""
    fingerprint = tool.precondition(call.arguments) if tool.precondition else ""
    needs_approval = tool.approval.requires_approval(call.arguments)
    previous = call.tool_version
    with lease.checkpoint() as cp:
        get_gate().cancel(cp=cp, call=call, reason="tool_version_changed")
        call.tool_version = tool.version
        call.effect = str(tool.effect)
        call.arguments_masked = tool.mask(call.arguments)
        call.precondition_fingerprint = fingerprint
        call.status = (
            ToolCall.Status.AWAITING_APPROVAL if needs_approval else ToolCall.Status.PROPOSED
        )
        call.save(
            update_fields=[
                "tool_version",
                "effect",
                "arguments_masked",
                "precondition_fingerprint",
                "status",
                "updated_at",
            ]
        )
        cp.event(
            "tool.version_changed",
            seq=step.seq,
            tool=call.tool_name,
            from_version=previous,
            to_version=tool.version,
            approval_required=needs_approval,
        )
        if needs_approval:
            get_gate().request(cp=cp, run=lease.run, call=call, tool=tool)
            cp.event("run.waiting", on="approval", seq=step.seq, tool=tool.name)
            cp.update(status=Run.Status.WAITING_APPROVAL, lease_owner="", lease_expires_at=None)
            cp.boundary("approval_requested")
    return Outcome.PARKED if needs_approval else Outcome.CONTINUE


def _dispatch(lease: Lease, step: Step, call: ToolCall, tool: Tool, *, execute: bool = True) -> str:
    """The ``dispatching`` boundary for an approved call or a re-dispatch with the same key:
    attempt incremented, approval consumed, precondition re-checked, in one transaction.
    ``execute=False`` (remote agents): stop there; the agent process calls the tool."""
    revoked = _principal_refusal(lease, tool)
    if revoked:
        _pause_principal_revoked(lease, revoked)
        return Outcome.PARKED
    if tool.precondition is not None:
        fingerprint = tool.precondition(call.arguments)  # may do I/O: outside the transaction
        if fingerprint != call.precondition_fingerprint:
            # The approver approved one world, never a different one: the approval is not
            # used, and the agent sees both fingerprints and decides again.
            with lease.checkpoint() as cp:
                get_gate().cancel(cp=cp, call=call, reason="precondition_changed")
                ToolCall.objects.filter(id=call.id).update(
                    status=ToolCall.Status.CANCELLED, updated_at=timezone.now()
                )
                cp.event(
                    "tool.cancelled",
                    seq=step.seq,
                    tool=call.tool_name,
                    reason="precondition_changed",
                    decided_fingerprint=call.precondition_fingerprint,
                    current_fingerprint=fingerprint,
                )
                _fail_step_in(
                    cp,
                    lease,
                    step,
                    "precondition changed since the call was decided: "
                    f"{call.precondition_fingerprint} -> {fingerprint}",
                )
            return Outcome.CONTINUE
    needs_approval = tool.approval.requires_approval(call.arguments)
    try:
        with lease.checkpoint() as cp:
            if call.status == ToolCall.Status.APPROVED:
                # approved calls always use their approval up, even when an edit brought the
                # arguments below the policy's threshold: an approval is never left to reuse
                get_gate().consume(cp=cp, call=call, tool=tool)
            elif needs_approval and call.attempt_count == 0:
                raise GateRefused("the call needs an approval it does not have")
            expected = call.status
            _mark_dispatching(cp, call, lease)
            updated = ToolCall.objects.filter(id=call.id, status=expected).update(
                status=call.status,
                attempt_count=call.attempt_count,
                dispatched_at=call.dispatched_at,
                dispatch_incarnation=call.dispatch_incarnation,
                reconcile_attempts=call.reconcile_attempts,
                # an operator's "dispatch again" is used up by this dispatch
                redispatch_authorized=False,
                updated_at=timezone.now(),
            )
            if updated != 1:
                raise LeaseLost(f"tool call {call.idempotency_key} changed under us")
    except GateRefused as exc:
        return _request_approval_again(lease, step, call, tool, str(exc))
    if not execute:
        return Outcome.CONTINUE
    return _execute(lease, step, call, tool)


def _request_approval_again(lease: Lease, step: Step, call: ToolCall, tool: Tool, why: str) -> str:
    with lease.checkpoint() as cp:
        get_gate().cancel(cp=cp, call=call, reason="superseded")
        ToolCall.objects.filter(id=call.id).update(
            status=ToolCall.Status.AWAITING_APPROVAL, updated_at=timezone.now()
        )
        call.status = ToolCall.Status.AWAITING_APPROVAL
        get_gate().request(cp=cp, run=lease.run, call=call, tool=tool)
        cp.event("run.waiting", on="approval", seq=step.seq, tool=tool.name, why=why)
        cp.update(status=Run.Status.WAITING_APPROVAL, lease_owner="", lease_expires_at=None)
        cp.boundary("approval_requested")
    return Outcome.PARKED


# --- calling the tool -------------------------------------------------------------------------


class _LeaseKeeper:
    """Renews the lease while a tool call is in flight (long calls must not lose it)."""

    def __init__(self, lease: Lease) -> None:
        self.lease = lease
        self.stop = threading.Event()
        self.lost = False
        self.thread = threading.Thread(target=self._run, daemon=True, name=f"lease-{lease.run.id}")

    def __enter__(self) -> _LeaseKeeper:
        self.thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop.set()
        self.thread.join()

    def _run(self) -> None:
        interval = max(_conf("LEASE_TTL") / 3, 0.05)
        try:
            while not self.stop.wait(interval):
                renewed = Run.objects.filter(id=self.lease.run.id, fence=self.lease.fence).update(
                    lease_expires_at=lease_expiry_expression()
                )
                if renewed != 1:
                    self.lost = True
                    return
        except Exception:
            log.exception("run %s: lease renewal failed", self.lease.run.id)
        finally:
            connection.close()


def _call_tool(
    lease: Lease, call: ToolCall, tool: Tool, *, attempt: int
) -> tuple[bool | None, ToolResult | None, str]:
    """The external call: (ok, result, error); ok is None when the outcome is unknown."""
    ctx = ToolContext(
        run_id=str(lease.run.id),
        idempotency_key=call.idempotency_key,
        attempt=attempt,
        timeout=tool.timeout,
    )
    from runs import faults

    ok: bool | None
    result: ToolResult | None = None
    error = ""
    # The last commit renewed the lease for a full TTL; only a call that may outlast half
    # of it needs a renewal thread.
    keeper = _LeaseKeeper(lease) if tool.timeout > _conf("LEASE_TTL") / 2 else nullcontext()
    with keeper:
        try:
            result = tool.call(call.arguments, ctx)
            ok = True
        except ToolFailed as exc:
            ok, error = False, _describe(exc)
        except OutcomeUnknown as exc:
            ok, error = None, _describe(exc)
        except Exception as exc:
            # Unexpected: we cannot tell whether the side effect happened.
            ok, error = None, _describe(exc)
    faults.crash_point("tool_call")
    return ok, result, error


def _execute(lease: Lease, step: Step, call: ToolCall, tool: Tool) -> str:
    ok, result, error = _call_tool(lease, call, tool, attempt=call.attempt_count)
    if ok is None:
        _mark_unknown(lease, call, error)
        return _reconcile(lease, step, call, tool)
    with lease.checkpoint(optimistic=True) as cp:
        # the receipt and both rows' new status go with the events (one statement on
        # PostgreSQL)
        _record_receipt(
            cp,
            lease,
            call,
            ok=ok,
            result=result.result if result else {"error": error},
            external_ref=result.external_ref if result else "",
            source=ToolReceipt.Source.TOOL,
            later=True,
        )
        _complete_step(
            cp, lease, step, call, ok, result.result if result else None, error, later=True
        )
    return Outcome.CONTINUE


def _record_receipt(
    cp,
    lease: Lease,
    call: ToolCall,
    *,
    ok: bool,
    result: Any,
    external_ref: str,
    source: str,
    later: bool = False,
) -> None:
    transitions.record_receipt(
        cp,
        call,
        ok=ok,
        result=result,
        external_ref=external_ref,
        source=source,
        recorded_by=lease.actor,
        incarnation=lease.fence,
        later=later,
    )


def _complete_step(
    cp,
    lease: Lease,
    step: Step,
    call: ToolCall,
    ok: bool,
    output: Any,
    error: str,
    *,
    later: bool = False,
) -> None:
    """``step_completed``: the outcome applied to the run's state (shares the receipt's commit)."""
    transitions.complete_step(
        cp,
        run=lease.run,
        agent=lease.agent,
        step=step,
        ok=ok,
        output=output,
        error=error,
        later=later,
    )


def _fail_step_in(cp, lease: Lease, step: Step, error: str) -> None:
    transitions.fail_step(cp, run=lease.run, agent=lease.agent, step=step, error=error)


def _fail_step(lease: Lease, step: Step, error: str) -> None:
    with lease.checkpoint() as cp:
        _fail_step_in(cp, lease, step, error)


# --- unknown outcomes (DESIGN §5.3) ------------------------------------------------------------


def _mark_unknown(lease: Lease, call: ToolCall, error: str) -> None:
    with lease.checkpoint() as cp:
        call.status = ToolCall.Status.UNKNOWN
        call.last_error = error
        ToolCall.objects.filter(id=call.id).update(
            status=call.status, last_error=error, updated_at=timezone.now()
        )
        cp.event(
            "tool.unknown",
            seq=call.step.seq,
            tool=call.tool_name,
            attempt=call.attempt_count,
            idempotency_key=call.idempotency_key,
            error=error,
        )


def _reconcile(
    lease: Lease, step: Step, call: ToolCall, tool: Tool, *, interrupted: bool = False
) -> str:
    """Decide an unknown outcome without ever repeating a side effect that may have happened.
    ``interrupted``: the call was left in dispatching by a process that died."""
    if tool.effect == Effect.READ:
        # No side effect: simply call it again. Only outcomes seen to be unknown count toward
        # READ_MAX_ATTEMPTS: an attempt cut short by a crash says nothing about the tool (a
        # crash loop ends at MAX_RECOVERIES). The count is written with the re-dispatch, so
        # a crash between the two cannot count one failure twice.
        failures = call.reconcile_attempts + (0 if interrupted else 1)
        if failures >= _conf("READ_MAX_ATTEMPTS"):
            _fail_step(lease, step, f"read tool failed {failures} times: {call.last_error}")
            return Outcome.CONTINUE
        call.reconcile_attempts = failures
        return _dispatch(lease, step, call, tool)
    if tool.effect == Effect.UNSAFE:
        _park_needs_attention(
            lease,
            Run.Reason.UNKNOWN_OUTCOME,
            f"{tool.name} (unsafe) may or may not have acted: {call.last_error}",
        )
        return Outcome.PARKED
    if tool.reconcile is None:
        # idempotent without a lookup: the external system deduplicates by key
        return _dispatch(lease, step, call, tool)

    if call.next_reconcile_at is not None and call.next_reconcile_at > lease.now():
        _release(lease, wake_at=call.next_reconcile_at)
        return Outcome.PARKED
    try:
        found = tool.reconcile(call.idempotency_key, call.arguments)
        outcome, detail = found.outcome, found.detail
    except Exception as exc:
        # a lookup that fails is NOT absence
        found, outcome, detail = None, LookupResult.UNKNOWN, _describe(exc)

    attempt = call.reconcile_attempts + 1
    if outcome == LookupResult.FOUND:
        with lease.checkpoint() as cp:
            ToolCall.objects.filter(id=call.id).update(
                reconcile_attempts=attempt, next_reconcile_at=None
            )
            cp.event(
                "tool.reconcile_attempted",
                seq=step.seq,
                attempt=attempt,
                outcome="found",
                detail=detail,
            )
            _record_receipt(
                cp,
                lease,
                call,
                ok=True,
                result=found.result,
                external_ref=found.external_ref,
                source=ToolReceipt.Source.RECONCILIATION,
            )
            _complete_step(cp, lease, step, call, True, found.result, "")
        return Outcome.CONTINUE

    if outcome == LookupResult.ABSENT:
        # Reliably absent. An idempotent system may simply get the same key again; any other
        # waits until the original request can no longer land.
        can_land_until = _can_land_until(lease, call, tool)
        must_wait = tool.effect != Effect.IDEMPOTENT and lease.now() < can_land_until
        with lease.checkpoint() as cp:
            ToolCall.objects.filter(id=call.id).update(
                reconcile_attempts=attempt, next_reconcile_at=can_land_until if must_wait else None
            )
            cp.event(
                "tool.reconcile_attempted",
                seq=step.seq,
                attempt=attempt,
                outcome="absent",
                detail=detail,
                redispatch_after=can_land_until.isoformat() if must_wait else None,
            )
            if must_wait:
                _release_in(cp, wake_at=can_land_until)
        if must_wait:
            return Outcome.PARKED
        call.reconcile_attempts = attempt
        return _dispatch(lease, step, call, tool)

    # the lookup could not decide: retry with backoff, then a person
    if attempt >= _conf("RECONCILE_MAX_ATTEMPTS"):
        with lease.checkpoint() as cp:
            ToolCall.objects.filter(id=call.id).update(
                reconcile_attempts=attempt, next_reconcile_at=None
            )
            cp.event(
                "tool.reconcile_attempted",
                seq=step.seq,
                attempt=attempt,
                outcome="unknown",
                detail=detail,
            )
        _park_needs_attention(
            lease,
            Run.Reason.UNKNOWN_OUTCOME,
            f"{tool.name}: reconciliation could not decide after {attempt} attempts: {detail}",
        )
        return Outcome.PARKED
    backoff = _conf("RECONCILE_BACKOFF") * (2 ** (attempt - 1))
    next_at = lease.now() + timedelta(seconds=backoff)
    with lease.checkpoint() as cp:
        ToolCall.objects.filter(id=call.id).update(
            reconcile_attempts=attempt, next_reconcile_at=next_at
        )
        cp.event(
            "tool.reconcile_attempted",
            seq=step.seq,
            attempt=attempt,
            outcome="unknown",
            detail=detail,
            retry_in_seconds=backoff,
        )
        _release_in(cp, wake_at=next_at)
    return Outcome.PARKED


def _can_land_until(lease: Lease, call: ToolCall, tool: Tool) -> datetime:
    """Until when a request sent at the call's last dispatch may still reach the system."""
    return (call.dispatched_at or lease.now()) + timedelta(
        seconds=tool.timeout + _conf("REDISPATCH_MARGIN")
    )


# --- releasing the lease ---------------------------------------------------------------------


def _release_in(cp, *, status: str = Run.Status.QUEUED, wake_at: datetime | None = None) -> None:
    cp.event("run.released", status=status, wake_at=wake_at.isoformat() if wake_at else None)
    cp.update(status=status, lease_owner="", lease_expires_at=None, wake_at=wake_at)


def _release(
    lease: Lease, *, status: str = Run.Status.QUEUED, wake_at: datetime | None = None
) -> None:
    with lease.checkpoint() as cp:
        _release_in(cp, status=status, wake_at=wake_at)


def _yield(lease: Lease) -> None:
    """End of a slice: let other runs have the worker, and ask to be woken again."""
    with lease.checkpoint() as cp:
        _release_in(cp)
        cp.update(enqueued_at=Now())
        enqueue_on_commit(lease.run.id)


def _park_needs_attention(lease: Lease, reason: str, detail: str) -> None:
    with lease.checkpoint() as cp:
        cp.event("run.needs_attention", reason=reason, detail=detail)
        cp.update(
            status=Run.Status.NEEDS_ATTENTION,
            reason_code=reason,
            reason_detail=detail,
            lease_owner="",
            lease_expires_at=None,
        )


def _finish(
    lease: Lease,
    status: str,
    *,
    result: Any = None,
    reason: str = "",
    detail: str = "",
    seq: int | None = None,
) -> None:
    # a decision that cost tokens updates its step in the body (_record_decision_usage), so
    # that step is inserted at once; otherwise the commit only records, without a lock
    at_commit = lease.decision_usage is None
    with lease.checkpoint(optimistic=at_commit) as cp:
        if seq is not None:
            kind = Step.Kind.FINISH if status == Run.Status.SUCCEEDED else Step.Kind.FAIL
            step = Step(
                run_id=lease.run.id,
                seq=seq,
                kind=kind,
                status=Step.Status.COMPLETED,
                input={"result": result} if kind == Step.Kind.FINISH else {"reason": detail},
                incarnation=lease.fence,
                completed_at=timezone.now(),
            )
            if at_commit:
                cp.insert(step)
            else:
                fastsql.insert(step)
            lease.steps.append(step)
            cp.event("step.decided", seq=seq, kind=kind)
            cp.update(steps_used=F("steps_used") + 1)
            cp.boundary("decided")
        cp.event(f"run.{status}", result=result, reason=reason, detail=detail)
        cp.update(
            status=status,
            result=result,
            reason_code=reason,
            reason_detail=detail,
            finished_at=Now(),
            lease_owner="",
            lease_expires_at=None,
        )
        cp.boundary("run_finished")

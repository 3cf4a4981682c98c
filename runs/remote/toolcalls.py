"""A remote agent's tool calls: propose (the policy decides), dispatch (the ``dispatching``
checkpoint before the side effect), and the receipt — from the tool or from a
reconciliation lookup by idempotency key."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

from django.db import IntegrityError, transaction
from django.db.models import F
from django.db.models.functions import Now

from runs import engine, flow, spend
from runs.actors import DRIVE_REMOTE_RUN, Actor
from runs.dbtime import db_now
from runs.gate import get_gate
from runs.models import Run, Step, ToolCall, ToolReceipt
from runs.record import transitions
from runs.record.checkpoint import LeaseLost
from runs.record.eventtypes import EventType
from runs.registry import CallTool, Effect, Resend, Tool, UnknownTool, digest, registry
from runs.remote.lease import (
    RemoteLease,
    _check_budget,
    _held,
    _prove_holder,
    _require_remote,
    holder_conditions,
    honour_request,
    lease_holder_check,
)
from runs.remote.manifest import SEP, _reported_fingerprint, short_tool_name
from runs.services import InvalidInput, InvalidState

# --- a dispatch's deadlines (DESIGN §9): the errors a remote agent acts on ---------------------


class SendDeadlinePassed(InvalidState):
    """The pre-send check refused: the dispatch's send deadline has passed. Do not send."""

    code = "send_deadline_passed"
    status = 409

    def __init__(self, message: str, *, send_deadline: datetime, resend_after: datetime):
        super().__init__(message)
        self.extra = {"send_deadline": send_deadline, "resend_after": resend_after}


class LookupRequired(InvalidInput):
    """An ``absent`` that names no lookup: the lookup must be begun first."""

    code = "lookup_required"
    status = 400


class LookupTooEarly(InvalidState):
    """The lookup began before the original request could no longer land: its ``absent``
    proves nothing about a request still on its way."""

    code = "lookup_too_early"
    status = 409

    def __init__(self, message: str, *, resend_after: datetime | None):
        super().__init__(message)
        self.extra = {"resend_after": resend_after}


class LookupSuperseded(InvalidState):
    code = "lookup_superseded"
    status = 409

    def __init__(self, message: str, *, latest_lookup: int):
        super().__init__(message)
        self.extra = {"latest_lookup": latest_lookup}


class ReconcileRequired(InvalidState):
    """An unknown outcome may not be dispatched again before it was reconciled."""

    code = "reconcile_required"
    status = 409


class DispatchTooEarly(InvalidState):
    code = "dispatch_too_early"
    status = 409

    def __init__(self, message: str, *, resend_after: datetime, wait_seconds: float):
        super().__init__(message)
        # how long that is from now by the database's clock (a client's clock may be off)
        self.extra = {"resend_after": resend_after, "wait_seconds": round(wait_seconds, 3)}


class ClientCallIdConflict(InvalidState):
    """A ``client_call_id`` the run already has, proposed with another tool or other
    arguments: the id names one call, and this request is not it."""

    code = "client_call_id_conflict"

    def __init__(self, message: str, *, tool_call: int):
        super().__init__(message)
        self.extra = {"tool_call": tool_call}


# the framework's own ids (OpenAI's ``call_...``, Anthropic's ``toolu_...``, UUIDs): printable
# ASCII without spaces, bounded
CLIENT_CALL_ID_MAX = 200
CLIENT_CALL_ID_PATTERN = r"^[\x21-\x7e]{1,200}$"


@dataclass(frozen=True)
class Proposal:
    decision: str  # approved | awaiting_approval | refused | paused | unknown | succeeded
    step: Step
    call: ToolCall | None
    approval_id: int | None
    error: str
    replayed: bool = False  # a retried request: the call its first attempt proposed


def _proposal(run_id: Any, step: Step, call: ToolCall | None, *, replayed: bool) -> Proposal:
    """What the tool's policy decided for this call, read from the record."""
    if call is None:
        return Proposal("refused", step, None, None, step.error, replayed)
    if call.status == ToolCall.Status.AWAITING_APPROVAL:
        pending = [
            a.id
            for a in get_gate().approvals_of([call.id]).get(call.id, [])
            if a.state == "pending"
        ]
        approval_id = pending[-1] if pending else None
        return Proposal("awaiting_approval", step, call, approval_id, "", replayed)
    if call.status in _SETTLED_DECISIONS:
        # answered again for its client_call_id after it settled: what became of it
        return Proposal(_SETTLED_DECISIONS[call.status], step, call, None, step.error, replayed)
    if Run.objects.filter(id=run_id, status=Run.Status.PAUSED).exists():
        return Proposal("paused", step, call, None, "the principal may not use this tool", replayed)
    if call.status == ToolCall.Status.UNKNOWN:
        # a fork's family already dispatched this key: reconcile it, never send it blindly
        return Proposal("unknown", step, call, None, call.last_error, replayed)
    if call.status == ToolCall.Status.SUCCEEDED:
        return Proposal("succeeded", step, call, None, "", replayed)
    return Proposal("approved", step, call, None, "", replayed)


_SETTLED_DECISIONS: dict[str, str] = {
    ToolCall.Status.REJECTED: "rejected",
    ToolCall.Status.FAILED: "failed",
    ToolCall.Status.CANCELLED: "cancelled",
}


# Where a propose itself leaves a run when it releases the lease: waiting for the approval,
# or paused because the principal may not use the tool.
_PARKED_BY_PROPOSE = (Run.Status.WAITING_APPROVAL, Run.Status.PAUSED)


def _replayed_proposal(
    run_id: Any,
    fence: int,
    tool: str,
    arguments: Any,
    *,
    statuses: tuple[str, ...],
    client_call_id: str = "",
) -> Proposal | None:
    """A retried propose (same fence, tool and arguments) whose first attempt's answer was
    lost: that attempt's call, still open and never dispatched, is the run's last step."""
    run = (
        Run.objects.filter(id=run_id, fence=fence, status__in=statuses)
        .only("id", "agent_name")
        .first()
    )
    if run is None:
        return None
    step = Step.objects.filter(run_id=run_id).order_by("-seq").first()
    if (
        step is None
        or step.kind != Step.Kind.TOOL_CALL
        or step.status != Step.Status.PENDING
        or step.incarnation != fence
    ):
        return None
    call = ToolCall.objects.select_related("step").filter(step=step).first()
    if (
        call is None
        or call.attempt_count
        or call.client_call_id != client_call_id
        or call.tool_name != f"{run.agent_name}{SEP}{tool}"
        or call.arguments_digest != digest(arguments)
    ):
        return None
    return _proposal(run_id, step, call, replayed=True)


def _call_with_client_id(
    run_id: Any, agent_name: str, client_call_id: str, tool: str, arguments: Any
) -> ToolCall | None:
    """The run's call proposed under ``client_call_id``, if any; ``ClientCallIdConflict`` if
    it was proposed with another tool or other arguments (compared by digest)."""
    call = (
        ToolCall.objects.select_related("step")
        .filter(run_id=run_id, client_call_id=client_call_id)
        .first()
    )
    if call is None:
        return None
    if call.tool_name != f"{agent_name}{SEP}{tool}" or call.arguments_digest != digest(arguments):
        raise ClientCallIdConflict(
            f"client_call_id {client_call_id!r} names call {call.id} "
            f"({short_tool_name(agent_name, call.tool_name)}, other arguments or another tool)"
            ": one id, one call — use a new id for a new call",
            tool_call=call.id,
        )
    return call


def _proposed_under_client_id(
    run_id: Any,
    fence: int,
    lease_token: str,
    actor: Actor,
    client_call_id: str,
    tool: str,
    arguments: Any,
) -> Proposal | None:
    """A propose naming a ``client_call_id`` the run already has: the same call, answered
    again (``replayed``) whatever has become of it since — to the holder of the run's current
    fence only (a process whose lease was taken over is told so)."""
    run = _require_remote(run_id, actor)
    lease_holder_check(run_id, fence, actor, lease_token)
    call = _call_with_client_id(run_id, run.agent_name, client_call_id, tool, arguments)
    if call is None:
        return None
    if not Run.objects.filter(id=run_id, fence=fence).exists():
        raise LeaseLost(f"fence {fence} does not hold run {run_id}'s lease; claim it again")
    return _proposal(run_id, call.step, call, replayed=True)


def remote_toolcall_propose(
    *,
    run_id: Any,
    fence: int,
    lease_token: str,
    actor: Actor,
    tool: str,
    arguments: Any,
    precondition: str = "",
    client_call_id: str = "",
) -> Proposal:
    """``decided``: the call is recorded as a step with its idempotency key, and the tool's
    policy decides — ``approved`` (dispatch it), ``awaiting_approval`` (the lease is released
    until a person decides; the approval.decided webhook says when), or ``refused`` (not the
    agent's tool, or arguments that break the schema: a failed step the agent sees).

    A retry by the same incarnation of a propose that was recorded (same tool and arguments,
    the call still open and not dispatched) gets the same proposal (``replayed``), also when
    the first attempt released the lease to wait for an approval. Another call while one is
    open is ``InvalidState``.

    ``client_call_id`` (optional): the agent's own id for the call (its framework's tool-call
    id), unique in the run. Proposed again — by this process or a successor replaying its
    framework's history — it answers the call first proposed under it, whatever its status
    (``replayed``), and never records a second; with another tool or other arguments it is
    ``ClientCallIdConflict``. The database's ``toolcall_run_client_id_uniq`` makes two
    simultaneous proposals under one id one call."""
    if not isinstance(arguments, dict):
        raise InvalidInput("arguments must be a JSON object")
    if client_call_id:
        replayed = _proposed_under_client_id(
            run_id, fence, lease_token, actor, client_call_id, tool, arguments
        )
        if replayed is not None:
            return replayed
    try:
        lease = _held(run_id, fence, actor, lease_token)
    except LeaseLost:
        # the first attempt may have released the lease itself (an approval is needed)
        lease_holder_check(run_id, fence, actor, lease_token)
        replayed = _replayed_proposal(
            run_id,
            fence,
            tool,
            arguments,
            statuses=_PARKED_BY_PROPOSE,
            client_call_id=client_call_id,
        )
        if replayed is None:
            raise
        return replayed
    if lease.open_step() is not None:
        replayed = _replayed_proposal(
            run_id,
            fence,
            tool,
            arguments,
            statuses=(Run.Status.RUNNING,),
            client_call_id=client_call_id,
        )
        if replayed is not None:
            return replayed
    honour_request(lease)
    if lease.open_step() is not None:
        raise InvalidState("a tool call is still open: record its receipt before the next one")
    _check_budget(lease)
    seq = (lease.steps[-1].seq + 1) if lease.steps else 1
    token = _reported_fingerprint.set(precondition or "")
    action = CallTool(f"{lease.run.agent_name}{SEP}{tool}", arguments, client_call_id)
    try:
        engine.decide_call(lease, action, seq, execute=False)
    except IntegrityError:
        # a simultaneous propose took this step (or this client_call_id) first, and this
        # one's commit was rolled back whole: under the same id it is the same call
        if not client_call_id:
            raise
        replayed = _proposed_under_client_id(
            run_id, fence, lease_token, actor, client_call_id, tool, arguments
        )
        if replayed is None:
            raise
        return replayed
    finally:
        _reported_fingerprint.reset(token)
    step = lease.steps[-1]
    call = ToolCall.objects.select_related("step").filter(step=step).first()
    return _proposal(run_id, step, call, replayed=False)


@dataclass(frozen=True)
class Dispatch:
    go: bool
    call: ToolCall
    reason: str
    # a repeated dispatch by the same fence: the original dispatch, its deadlines unchanged
    replayed: bool = False
    timeout: float | None = None
    # the run is a dry run (issue 23); ``execute`` false: do not call the tool, report what
    # it would do (a dry run's call of a tool that is not read)
    dry_run: bool = False
    execute: bool = True


_DRY_RUN_REASON = (
    "dry run: do not execute the tool; report what it would do as the receipt (recorded as "
    "simulated)"
)


def _simulated(lease: RemoteLease, call: ToolCall) -> bool:
    """A dry run's call of a tool that is not ``read``: the process must not execute it,
    and its receipt is recorded as ``simulated``. From the call's recorded effect class (a
    retired tool's call is judged as it was proposed)."""
    return lease.run.dry_run and call.effect != Effect.READ


def _call_for_lease(
    tool_call_id: Any, fence: int, actor: Actor, lease_token: str
) -> tuple[RemoteLease, ToolCall]:
    call = ToolCall.objects.select_related("step").filter(id=tool_call_id).first()
    if call is None:
        raise ToolCall.DoesNotExist(f"tool call {tool_call_id} does not exist")
    lease = _held(call.run_id, fence, actor, lease_token)
    return lease, call


def _registered(call: ToolCall) -> Tool | None:
    try:
        return registry.tool(call.tool_name)
    except UnknownTool:
        return None


def _tool_of(call: ToolCall) -> Tool | None:
    """The call's tool, as it was when the call was proposed (None: retired or changed)."""
    tool = _registered(call)
    return tool if tool is not None and tool.accepts(call.tool_version) else None


def _absent_accepted(call: ToolCall, tool: Tool, landing: datetime) -> bool:
    """The latest lookup begun reported ``absent`` and was accepted: it started after this
    attempt's landing deadline (or the downstream deduplicates by key)."""
    if call.absent_lookup is None or call.absent_lookup != call.lookups_begun:
        return False
    if tool.honours_key:
        return True
    return call.lookup_started_at is not None and call.lookup_started_at >= landing


def _check_redispatch(lease: RemoteLease, call: ToolCall, tool: Tool) -> None:
    """An unknown outcome is dispatched again only when that cannot repeat its effect
    (DESIGN §9): a read; a tool whose downstream deduplicates by key and has no lookup;
    after an accepted ``absent`` from a lookup that started after the landing deadline; or,
    for a tool with no lookup, after an operator's "dispatch again" once the landing deadline
    has passed (database time)."""
    if tool.effect == Effect.READ or (tool.honours_key and tool.reconcile is None):
        return
    landing = engine.can_land_until(lease, call, tool)
    if tool.reconcile is not None:
        if not _absent_accepted(call, tool, landing):
            raise ReconcileRequired(
                "the outcome is unknown: begin a lookup (POST /tool-calls/{id}/lookups/), look "
                "the key up, and record what it found (a receipt with source reconciliation: "
                "succeeded, failed, or absent naming the lookup) before dispatching it again"
            )
        if tool.resend == Resend.PERSON and not call.redispatch_authorized:
            raise InvalidState("resend: person — an operator decides whether to send it again")
        return
    if not call.redispatch_authorized:
        raise ReconcileRequired(
            f"{call.tool_name} has no lookup by key and its downstream does not deduplicate: "
            "a person resolves the unknown outcome (POST /tool-calls/{id}/resolution/)"
        )
    now = db_now()
    if now < landing:
        raise DispatchTooEarly(
            f"the original request may still land until {landing.isoformat()}; dispatch "
            "again after that",
            resend_after=landing,
            wait_seconds=(landing - now).total_seconds(),
        )


def remote_toolcall_dispatch(
    *, tool_call_id: Any, fence: int, lease_token: str, actor: Actor, precondition: str = ""
) -> Dispatch:
    """``dispatching`` through the engine's own ``dispatch``: attempt incremented, the
    approval consumed, the precondition re-checked, in one commit before the side effect;
    the dispatch's ``send_deadline`` and ``landing_deadline`` computed in database time by
    that commit. ``go`` is false when the engine refused (approval needed again,
    precondition changed): the call's status says what happened.

    A repeated dispatch by the same fence — also one sent at the same time as the first — is
    answered with the original dispatch and its deadlines (``replayed``): the dispatch is
    decided under the run row's lock, which every checkpoint takes first, so a concurrent
    repeat waits for the first to commit and then reads what it recorded. An unknown outcome
    is dispatched again only as ``_check_redispatch`` allows."""
    lease, call = _call_for_lease(tool_call_id, fence, actor, lease_token)
    honour_request(lease)
    step = lease.open_step()
    if step is None or step.id != call.step_id:
        raise InvalidState(f"the call is {call.status}; it is not the run's open step")
    try:
        replayed = _dispatch_in_transaction(lease, step, call, fence, precondition)
    except flow.AtCapacity as full:
        # in the fair line with the hosted runs: its turn is kept for it (issue 26)
        flow.join_line(lease.run, full)
        raise
    except spend.CapReached as full:
        # a spend cap's scope is used up: nothing is dispatched, the run stops for a top-up
        with lease.checkpoint() as cp:
            spend.stop_run(cp, run=lease.run, full=full)
        call.refresh_from_db()
        return Dispatch(False, call, f"the run stopped: {full.detail}")
    if replayed is not None:
        return replayed
    call.refresh_from_db()
    return _dispatch_outcome(lease, call)


def _dispatch_in_transaction(
    lease: RemoteLease, step: Step, call: ToolCall, fence: int, precondition: str
) -> Dispatch | None:
    """The dispatch's one transaction; a ``Dispatch`` when it is answered without the engine
    (a repeat, a changed tool), else None (the call's status says what happened)."""
    with transaction.atomic():
        # nothing here waits for I/O: a remote tool's precondition is the fingerprint the
        # agent reported, and the tool call itself is the agent's, after this commit
        Run.objects.select_for_update().filter(id=call.run_id).values_list("id").first()
        call = ToolCall.objects.select_related("step").get(id=call.id)
        tool = _registered(call)
        timeout = tool.timeout if tool is not None else None
        dry = {"dry_run": lease.run.dry_run, "execute": not _simulated(lease, call)}
        if call.status == ToolCall.Status.DISPATCHING and call.dispatch_incarnation == fence:
            return Dispatch(
                True, call, "already dispatching (a repeated request)", True, timeout, **dry
            )
        if call.status not in ToolCall.OPEN:
            # settled (a receipt, a rejection): before any compatibility check, which must
            # never fail a call that settled
            raise InvalidState(f"the call is {call.status}; it cannot be dispatched")
        if not engine.tool_accepts(lease, step, call, tool):
            engine.tool_changed(lease, step, call, tool)
            call.refresh_from_db()
            return Dispatch(False, call, "the tool changed since the call was proposed")
        assert tool is not None  # tool_accepts refuses a tool no longer registered
        if call.status == ToolCall.Status.UNKNOWN:
            _check_redispatch(lease, call, tool)
        elif call.status not in (ToolCall.Status.PROPOSED, ToolCall.Status.APPROVED):
            raise InvalidState(f"the call is {call.status}; it cannot be dispatched")
        token = _reported_fingerprint.set(precondition or "")
        try:
            engine.dispatch(lease, step, call, tool, execute=False)
        finally:
            _reported_fingerprint.reset(token)
    return None


def _dispatch_outcome(lease: RemoteLease, call: ToolCall) -> Dispatch:
    tool = _registered(call)
    timeout = tool.timeout if tool is not None else None
    dry = {"dry_run": lease.run.dry_run, "execute": not _simulated(lease, call)}
    if call.status == ToolCall.Status.DISPATCHING:
        return Dispatch(
            True, call, _DRY_RUN_REASON if not dry["execute"] else "", False, timeout, **dry
        )
    if call.status == ToolCall.Status.AWAITING_APPROVAL:
        return Dispatch(False, call, "the call needs an approval again; the lease is released")
    if call.status == ToolCall.Status.CANCELLED:
        # the precondition changed, or the current approval policy denies the call: the
        # failed step's error says which (the agent reads it in its resume packet too)
        why = Step.objects.filter(id=call.step_id).values_list("error", flat=True).first()
        return Dispatch(False, call, f"the call is cancelled: {why or 'precondition changed'}")
    return Dispatch(False, call, f"the call is {call.status}")


# --- just before the request leaves ------------------------------------------------------------


@dataclass(frozen=True)
class SendClearance:
    """The pre-send check passed: the request may leave now, and no later than
    ``send_deadline`` (database time; ``send_seconds_left`` of it were left at the check)."""

    tool_call_id: int
    fence: int
    attempt: int
    dispatched_at: datetime
    send_deadline: datetime
    landing_deadline: datetime
    checked_at: datetime

    @property
    def send_seconds_left(self) -> float:
        return max(0.0, (self.send_deadline - self.checked_at).total_seconds())


def remote_toolcall_send_check(
    *, tool_call_id: Any, fence: int, lease_token: str, attempt: int, actor: Actor
) -> SendClearance:
    """DESIGN §9 for remote agents: immediately before its tool call the agent asks, and ONE
    query answers, whether ``fence`` still holds the running run, the call is still that
    fence's dispatch ``attempt``, and the database's clock is before the send deadline
    (``engine.presend_row``, the hosted worker's own check). Refused: ``LeaseLost`` (another
    process took over, the lease was released), ``SendDeadlinePassed``, or ``InvalidState``
    (the call is no longer that dispatch) — and the agent must not send. Writes nothing."""
    actor.require(DRIVE_REMOTE_RUN)
    # the holder's proof and the ownership are part of the one query: a clearance is only given to the holder
    row = engine.presend_row(
        tool_call_id, fence=fence, attempt=attempt, holder=holder_conditions(actor, lease_token)
    )
    if row is not None:
        dispatched_at, send_deadline, landing_deadline, checked_at = row
        return SendClearance(
            int(tool_call_id),
            fence,
            attempt,
            dispatched_at,
            send_deadline,
            landing_deadline,
            checked_at,
        )
    # refused; what follows only explains the refusal to the agent
    call = ToolCall.objects.select_related("run").filter(id=tool_call_id).first()
    if call is None:
        raise ToolCall.DoesNotExist(f"tool call {tool_call_id} does not exist")
    run = call.run
    actor.require_driver(run.agent_name)
    _prove_holder(run, fence, actor, lease_token)
    if run.fence != fence or run.status != Run.Status.RUNNING:
        raise LeaseLost(
            f"fence {fence} does not hold run {run.id}'s lease: do not send; stop advancing it"
        )
    if (
        call.status != ToolCall.Status.DISPATCHING
        or call.dispatch_incarnation != fence
        or call.attempt_count != attempt
    ):
        raise InvalidState(
            f"the call is {call.status} at attempt {call.attempt_count}: not fence {fence}'s "
            f"dispatch attempt {attempt}; do not send"
        )
    # this fence's dispatch attempt: the dispatching commit set both deadlines
    assert call.send_deadline is not None and call.landing_deadline is not None
    raise SendDeadlinePassed(
        f"the send deadline {call.send_deadline.isoformat()} has passed: do not send; report "
        "not_sent (or unknown) and reconcile the call",
        send_deadline=call.send_deadline,
        resend_after=call.landing_deadline,
    )


# --- reconciliation lookups --------------------------------------------------------------------


@dataclass(frozen=True)
class LookupBegun:
    call: ToolCall
    number: int
    started_at: datetime
    resend_after: datetime | None

    @property
    def absent_allows_resend(self) -> bool:
        """Whether an ``absent`` from this lookup may let the call be sent again (it began
        after the landing deadline, or the downstream deduplicates by key)."""
        return self.resend_after is None or self.started_at >= self.resend_after


def remote_toolcall_lookup_begin(
    *, tool_call_id: Any, fence: int, lease_token: str, actor: Actor
) -> LookupBegun:
    """Record, in database time, that a reconciliation lookup of the call by its key is
    beginning — before the agent sends it. Its ``absent`` (a receipt naming ``number``)
    allows a re-send only if it began after the landing deadline (``resend_after``) and is
    still the latest lookup begun: a lookup that began earlier may have looked before the
    original request landed."""
    lease, call = _call_for_lease(tool_call_id, fence, actor, lease_token)
    if call.status not in (ToolCall.Status.UNKNOWN, ToolCall.Status.DISPATCHING):
        raise InvalidState(f"the call is {call.status}: there is nothing to reconcile")
    tool = _tool_of(call)
    honours_key = tool is not None and tool.honours_key
    with lease.checkpoint() as cp:
        ToolCall.objects.filter(id=call.id).update(
            lookups_begun=F("lookups_begun") + 1, lookup_started_at=Now()
        )
        call.refresh_from_db()
        assert call.lookup_started_at is not None  # set to Now() by the update just above
        landing = None
        if not honours_key:
            landing = (
                engine.can_land_until(lease, call, tool)
                if tool is not None
                else call.landing_deadline
            )
        cp.event(
            EventType.TOOL_LOOKUP_BEGUN,
            seq=call.step.seq,
            lookup=call.lookups_begun,
            started_at=call.lookup_started_at.isoformat(),
            resend_after=landing.isoformat() if landing else None,
        )
    return LookupBegun(call, call.lookups_begun, call.lookup_started_at, landing)


RECEIPT_OUTCOMES = ("succeeded", "failed", "unknown", "not_sent", "absent")


def remote_toolcall_receipt(
    *,
    tool_call_id: Any,
    fence: int,
    lease_token: str,
    actor: Actor,
    outcome: str,
    result: Any = None,
    external_ref: str = "",
    source: str = ToolReceipt.Source.AGENT,
    state: Any = None,
    lookup: int | None = None,
) -> ToolCall:
    """``receipt_recorded`` + ``step_completed`` in one commit. ``source`` is ``agent`` (the
    tool answered) or ``reconciliation`` (a lookup by idempotency key answered).
    ``unknown``: the call timed out or failed ambiguously, reconcile it next. ``not_sent``
    (agent only): the agent's own report that this attempt's request never left (the
    pre-send check refused it) — recorded as such, and still reconciled as an unknown
    outcome, since nothing here can verify it. ``absent`` (reconciliation only): the key was
    looked up and reliably not found, by the lookup ``lookup`` (``remote_toolcall_lookup_
    begin``); accepted only from the latest lookup begun, and — unless the downstream
    deduplicates by key — only if it began after the landing deadline. Accepted, the call
    may be dispatched again with the same key (``resend: person``: the run goes to a
    person instead). A pause or terminate request is honoured right after the receipt is
    recorded."""
    if outcome not in RECEIPT_OUTCOMES:
        raise InvalidInput(f"outcome must be one of {', '.join(RECEIPT_OUTCOMES)}")
    if source not in (ToolReceipt.Source.AGENT, ToolReceipt.Source.RECONCILIATION):
        raise InvalidInput("source must be agent or reconciliation")
    reconciling = source == ToolReceipt.Source.RECONCILIATION
    if outcome == "absent" and not reconciling:
        raise InvalidInput("absent is what a reconciliation lookup reports")
    if outcome == "not_sent" and reconciling:
        raise InvalidInput("not_sent is what the agent reports of its own attempt")
    if outcome == "absent" and lookup is None:
        raise LookupRequired(
            "an absent must name its lookup: begin one with POST /tool-calls/{id}/lookups/ "
            "before looking the key up, and send its number as lookup"
        )
    lease, call = _call_for_lease(tool_call_id, fence, actor, lease_token)
    if not reconciling and _simulated(lease, call):
        # what the agent reports of a dry run's call is what it would have done
        source = ToolReceipt.Source.SIMULATED
    receipt = getattr(call, "receipt", None)
    if receipt is not None:
        if receipt.outcome == outcome and receipt.source == source:
            return call  # a retried request: recorded once
        raise InvalidState(f"the call already has a {receipt.outcome} receipt")
    if reconciling and call.status not in (ToolCall.Status.UNKNOWN, ToolCall.Status.DISPATCHING):
        raise InvalidState(f"the call is {call.status}: there is nothing to reconcile")
    if not reconciling and call.status != ToolCall.Status.DISPATCHING:
        raise InvalidState(f"the call is {call.status}; only a dispatched call gets a receipt")
    step = call.step
    if outcome in ("unknown", "not_sent"):
        if reconciling:
            with lease.checkpoint() as cp:
                attempt = call.reconcile_attempts + 1
                ToolCall.objects.filter(id=call.id).update(reconcile_attempts=attempt)
                cp.event(
                    EventType.TOOL_RECONCILE_ATTEMPTED,
                    seq=step.seq,
                    attempt=attempt,
                    outcome="unknown",
                    lookup=lookup,
                    detail=str(result or "")[:2000],
                )
        else:
            detail = str(result or "outcome unknown")
            if outcome == "not_sent":
                detail = f"not sent (the agent's report of attempt {call.attempt_count}): {detail}"
            engine.mark_unknown(lease, call, detail[:2000])
            tool = _tool_of(call)
            if tool is not None and engine.unknown_needs_person(tool):
                engine.park_unknown_outcome(lease, call)
        call.refresh_from_db()
        return call
    if outcome == "absent":
        assert lookup is not None  # LookupRequired above
        return _record_absent(lease, call, lookup)
    ok = outcome == "succeeded"
    with lease.checkpoint() as cp:
        if reconciling:
            attempt = call.reconcile_attempts + 1
            ToolCall.objects.filter(id=call.id).update(
                reconcile_attempts=attempt, next_reconcile_at=None
            )
            cp.event(
                EventType.TOOL_RECONCILE_ATTEMPTED,
                seq=step.seq,
                attempt=attempt,
                outcome="found" if ok else "failed",
                lookup=lookup,
            )
        engine.record_receipt(
            cp, lease, call, ok=ok, result=result, external_ref=external_ref, source=source
        )
        engine.complete_step(
            cp, lease, step, call, ok, result if ok else None, "" if ok else str(result)[:2000]
        )
        if state is not None:
            cp.update(state=state, state_version=F("state_version") + 1)
    engine.honour_request(lease)
    call.refresh_from_db()
    return call


def _record_absent(lease: RemoteLease, call: ToolCall, lookup: int) -> ToolCall:
    """An ``absent`` naming lookup ``lookup``: refused unless it is the latest lookup begun
    and (the downstream not deduplicating) it began after the landing deadline; accepted,
    the call stays ``unknown`` and may be dispatched again — or, ``resend: person``, the
    run goes to a person."""
    if call.absent_lookup == lookup and call.status == ToolCall.Status.UNKNOWN:
        return call  # a retried report: recorded once
    if lookup != call.lookups_begun:
        raise LookupSuperseded(
            f"lookup {lookup} is not the latest lookup begun ({call.lookups_begun}): report "
            "that one, or begin a new one",
            latest_lookup=call.lookups_begun,
        )
    tool = _tool_of(call)
    landing = (
        engine.can_land_until(lease, call, tool) if tool is not None else call.landing_deadline
    )
    started = call.lookup_started_at
    if not engine.absent_proves_never_landed(tool, started, landing):
        raise LookupTooEarly(
            f"lookup {lookup} began at {started.isoformat() if started else '?'}, before the "
            f"original request could no longer land ({landing.isoformat() if landing else '?'})"
            ": it may have looked before the request arrived. Begin a new lookup after "
            "resend_after and look again",
            resend_after=landing,
        )
    with lease.checkpoint() as cp:
        transitions.call_absent_accepted(
            cp, call, lookup=lookup, started_at=started.isoformat() if started else None
        )
    if engine.resend_needs_person(tool, authorized=call.redispatch_authorized):
        engine.park_resend_for_person(lease, call)
    call.refresh_from_db()
    return call

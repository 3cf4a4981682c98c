# size: one concern, the spend caps' services above the record (checking and reserving in the
# deciding and dispatching commits, cut-off requests, stopping and resuming runs, the 80 % alert,
# the operators' services, views and metrics); the rules the record needs are runs/spendrules.py
"""Spend and token caps by scope and period (issue 26 item 3; DESIGN §9; docs/agents.md
"Spend caps", docs/operations.md "Spend caps").

An operator caps what runs may spend (money, tokens, or both) per agent, per principal, per
principal per day, or for everything per day (days in ``AGENTOPS["SPEND_TIME_ZONE"]``).
Each scope's spend in a period is one ``SpendCounter`` row: settled usage, what calls in
flight have reserved, and the operators' top-ups. Before each model request and each tool
dispatch of a run in a capped scope, the scope's counters are locked in that commit's
transaction (the deciding or the ``dispatching`` one) and checked: a scope whose usage plus
reservations reached its cap stops the run (``needs_attention``, ``budget_exhausted``, the
scope named in the reason and in a ``spend.cap_reached`` event) — never terminated. Else the
call's declared maximum is reserved in the same transaction, so concurrent calls overshoot a
cap by one call's reservation at most; the receipt (or the model's answer) settles it at the
real usage. An operator's top-up (``spend_top_up``, audited) resumes every run the scope
stopped.

Spend a crash cut off counts too: an agent that asks a model (``Agent.decision_maximum``)
reserves the request's declared maximum in a commit of its own before it asks. The
``decided`` commit settles it at the model's real usage. A reservation an incarnation left
held (it crashed, or lost its lease, before its decision was saved) is ``cut_off`` by the
next one: charged to the run's usage at its maximum, and kept charged in its scopes, until
an operator settles it with the real usage (``spend_reservation_settle``).

With no caps configured nothing here runs on the hot path: which caps exist is known
in-process, re-read only when the claim statement reports that they changed
(``runs.record.configcache``), and a tool call of an uncapped run is dispatched as before.
Dry runs are never counted against caps.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import datetime
from decimal import Decimal, InvalidOperation
from typing import Any

from django.conf import settings
from django.db import transaction
from django.db.models import F, Q

from runs.errors import InvalidInput, InvalidState, NotFound
from runs.models import Run, SpendCap, SpendCounter, SpendReservation, SpendStop
from runs.record import configcache
from runs.record.eventtypes import EventType
from runs.spendrules import (
    DAY_SCOPES,
    EVERY_PRINCIPAL,
    PRINCIPAL_SCOPES,
    ZERO,
    CapLimit,
    Scope,
    applies,
    cap_of,
    scopes_of,
    settle,
    today,
)

log = logging.getLogger(__name__)

_MAX_COST = Decimal(10**6)  # SpendCap.max_cost: 12 digits, 6 of them decimals
REASON_PREFIX = "spend cap reached: "


# --- checking and reserving (inside the deciding or dispatching transaction) -------------------


def limit_of(counter: SpendCounter, cap: CapLimit) -> tuple[Decimal | None, int | None]:
    """The counter's limits in its period: the cap plus that period's top-ups."""
    cost = None if cap.max_cost is None else cap.max_cost + counter.cost_added
    tokens = None if cap.max_tokens is None else cap.max_tokens + counter.tokens_added
    return cost, tokens


def reached(counter: SpendCounter, cap: CapLimit) -> str:
    """Why the scope can take no more ("" while it can): its usage plus what is reserved
    reached a limit."""
    cost, tokens = limit_of(counter, cap)
    if cost is not None and counter.cost_used + counter.cost_reserved >= cost:
        return f"cost {counter.cost_used + counter.cost_reserved} of {cost}"
    if tokens is not None and counter.tokens_used + counter.tokens_reserved >= tokens:
        return f"{counter.tokens_used + counter.tokens_reserved} of {tokens} tokens"
    return ""


def _share(counter: SpendCounter, cap: CapLimit) -> float:
    """How much of its limit the scope has used or reserved (1.0: all of it)."""
    cost, tokens = limit_of(counter, cap)
    shares = [0.0]
    if cost is not None:
        spent = counter.cost_used + counter.cost_reserved
        shares.append(float(spent / cost) if cost > 0 else 1.0)
    if tokens is not None:
        spent_tokens = counter.tokens_used + counter.tokens_reserved
        shares.append(spent_tokens / tokens if tokens > 0 else 1.0)
    return max(shares)


class CapReached(Exception):
    """A scope the run counts in has no room left: the run stops for a top-up."""

    def __init__(self, counter: SpendCounter, cap: CapLimit, why: str) -> None:
        self.counter, self.cap, self.why = counter, cap, why
        super().__init__(f"{REASON_PREFIX}{describe(counter)}: {why}")

    @property
    def detail(self) -> str:
        return f"{self} used; an operator's top-up of this scope resumes the run"


def _lock_counters(
    scopes: list[tuple[str, str, str, CapLimit]],
) -> list[tuple[SpendCounter, CapLimit]]:
    """The scopes' counters (created at their first use), locked, in id order (every
    transaction locks them in that order: no deadlock)."""
    SpendCounter.objects.bulk_create(
        [SpendCounter(scope=s, subject=subject, period=p) for s, subject, p, _cap in scopes],
        ignore_conflicts=True,
    )
    wanted = Q()
    for scope, subject, period, _cap in scopes:
        wanted |= Q(scope=scope, subject=subject, period=period)
    rows = list(SpendCounter.objects.select_for_update().filter(wanted).order_by("id"))
    caps = {(s, subject, p): cap for s, subject, p, cap in scopes}
    return [(row, caps[(row.scope, row.subject, row.period)]) for row in rows]


def check(cp: Any, *, run: Run, now: datetime | None = None) -> list[tuple[SpendCounter, CapLimit]]:
    """Lock the run's capped scopes' counters in the commit ``cp`` and raise ``CapReached``
    when one has no room left. Nothing is written before that (the counters of a first use
    aside), so the caller may park the run in the same commit."""
    scopes = scopes_of(run, now)
    if not scopes:
        return []
    cp.lock()  # bulk_create opens a transaction of its own: the run is locked first
    counters = _lock_counters(scopes)
    for counter, cap in counters:
        why = reached(counter, cap)
        if why:
            raise CapReached(counter, cap, why)
    return counters


def _hold(cp: Any, counters: list[tuple[SpendCounter, CapLimit]], cost: Decimal, tokens: int):
    """Add a reservation to the (locked) counters; the 80 % alert when one crosses it."""
    if not (cost or tokens):
        return
    for counter, cap in counters:
        before = _share(counter, cap)
        SpendCounter.objects.filter(pk=counter.pk).update(
            cost_reserved=F("cost_reserved") + cost, tokens_reserved=F("tokens_reserved") + tokens
        )
        counter.cost_reserved += cost
        counter.tokens_reserved += tokens
        _warn_if_crossed(cp, counter, cap, before)


def reserve(
    cp: Any,
    *,
    run: Run,
    kind: str,
    cost: Decimal,
    tokens: int,
    fence: int,
    tool_call: Any = None,
    now: datetime | None = None,
    counters: list[tuple[SpendCounter, CapLimit]] | None = None,
) -> SpendReservation | None:
    """Check the run's caps (``CapReached``) and reserve ``cost`` and ``tokens`` in them, in
    the commit ``cp``. A model request's reservation is written even with no cap (the run's
    own budget counts it when a crash cuts it off); a tool's only where a cap counts it."""
    if counters is None:
        counters = check(cp, run=run, now=now)
    _hold(cp, counters, cost, tokens)
    if not (cost or tokens) or (kind == SpendReservation.Kind.TOOL and not counters):
        return None
    reservation = SpendReservation(
        run_id=run.id,
        kind=kind,
        tool_call=tool_call,
        incarnation=fence,
        cost=cost,
        tokens=tokens,
        counters=[counter.pk for counter, _cap in counters],
    )
    cp.insert(reservation)
    return reservation


def reserve_tool(cp: Any, *, run: Run, call: Any, tool: Any, fence: int) -> None:
    """The ``dispatching`` transaction of a run a cap covers: check its caps and reserve the
    tool's declared maximum (``Tool.max_cost``, ``Tool.max_tokens``). A re-dispatch of a call
    in doubt (``attempt_count`` > 0) is reconciliation, not a new call: its first dispatch's
    reservation is still held, and no cap stops it."""
    if call.attempt_count > 0:
        return
    reserve(
        cp,
        run=run,
        kind=SpendReservation.Kind.TOOL,
        cost=tool.max_cost or ZERO,
        tokens=tool.max_tokens or 0,
        fence=fence,
        tool_call=call,
    )


def charge_reported(cp: Any, *, run: Run, cost: Any, tokens: Any) -> None:
    """Usage an agent process reports after the fact (a remote agent's step): added to the
    run's scopes as used, in the commit that records it — it was never reserved first."""
    cost = Decimal(str(cost or 0))
    tokens = int(tokens or 0)
    if not (cost or tokens):
        return
    scopes = scopes_of(run)
    if not scopes:
        return
    cp.lock()  # bulk_create opens a transaction of its own
    for counter, cap in _lock_counters(scopes):
        before = _share(counter, cap)
        SpendCounter.objects.filter(pk=counter.pk).update(
            cost_used=F("cost_used") + cost, tokens_used=F("tokens_used") + tokens
        )
        counter.cost_used += cost
        counter.tokens_used += tokens
        _warn_if_crossed(cp, counter, cap, before)


def stop_if_full(lease: Any) -> str:
    """Before a remote agent's step is recorded: a scope that is used up stops the run as a
    hosted run stops (one commit, for runs a cap covers only). The reason, or ""."""
    if not applies(lease.run):
        return ""
    stopped = ""
    with lease.checkpoint() as cp:
        try:
            check(cp, run=lease.run)
        except CapReached as full:
            stop_run(cp, run=lease.run, full=full)
            stopped = full.detail
    return stopped


# --- a model request: reserved in a commit of its own, before it is asked ----------------------


def charge_cut_off(cp: Any, *, run: Run, fence: int) -> tuple[Decimal, int]:
    """Model reservations an earlier incarnation left held: it crashed (or lost its lease)
    after asking and before its decision was saved, so the model may have answered and billed.
    Each is ``cut_off``: charged to the run's usage at its maximum (the run's budget counts
    it) and kept charged in its scopes until an operator settles it with the real usage."""
    held = list(
        SpendReservation.objects.filter(
            run_id=run.id, kind=SpendReservation.Kind.MODEL, state=SpendReservation.State.HELD
        ).exclude(incarnation=fence)
    )
    if not held:
        return ZERO, 0
    cost = sum((r.cost for r in held), ZERO)
    tokens = sum(r.tokens for r in held)
    SpendReservation.objects.filter(pk__in=[r.pk for r in held]).update(
        state=SpendReservation.State.CUT_OFF
    )
    add_usage(cp, tokens=tokens, cost=cost)
    cp.event(
        EventType.SPEND_CUT_OFF,
        reservations=[r.pk for r in held],
        incarnations=sorted({r.incarnation for r in held}),
        tokens=tokens,
        cost=cost,
    )
    run.tokens_used += tokens
    run.cost_used += cost
    return cost, tokens


def add_usage(cp: Any, *, tokens: int, cost: Decimal) -> None:
    """Add to the run's persisted usage in the commit ``cp``, together with anything else
    the commit adds (``F(...) + n`` once)."""
    for name, amount in (("tokens_used", tokens), ("cost_used", cost)):
        if not amount:
            continue
        pending = cp.updates.get(name)
        if pending is not None and hasattr(pending, "rhs"):
            amount = pending.rhs.value + amount
        cp.update(**{name: F(name) + amount})


# --- stopping and resuming ---------------------------------------------------------------------


def stop_run(cp: Any, *, run: Run, full: CapReached) -> None:
    """The run stops the way an exhausted budget stops it (``needs_attention``,
    ``budget_exhausted``), the scope named; remembered so that a top-up of the scope resumes
    it."""
    from runs.record.runs import run_park

    counter = full.counter
    cost, tokens = limit_of(counter, full.cap)
    cp.lock()  # bulk_create and update_or_create open a transaction of their own
    # the counter may have been created by the dispatch transaction that was rolled back
    key = {"scope": counter.scope, "subject": counter.subject, "period": counter.period}
    SpendCounter.objects.bulk_create([SpendCounter(**key)], ignore_conflicts=True)
    counter_id = SpendCounter.objects.filter(**key).values_list("pk", flat=True).get()
    SpendStop.objects.update_or_create(run_id=run.id, defaults={"counter_id": counter_id})
    cp.event(
        EventType.SPEND_CAP_REACHED,
        scope=counter.scope,
        subject=counter.subject,
        period=counter.period,
        cost_used=counter.cost_used,
        cost_reserved=counter.cost_reserved,
        max_cost=cost,
        tokens_used=counter.tokens_used,
        tokens_reserved=counter.tokens_reserved,
        max_tokens=tokens,
    )
    run_park(cp, Run.Reason.BUDGET_EXHAUSTED, full.detail)
    marker = _marker(counter, full.cap)
    cp.on_commit(lambda: _alert(counter_id, marker, level=100, detail=full.detail))


def describe(counter: SpendCounter | Any) -> str:
    """The scope as people read it: "principal alice per day (2026-12-05)"."""
    scope, subject, period = counter.scope, counter.subject, counter.period
    if scope == Scope.AGENT:
        text = f"agent {subject}"
    elif scope in PRINCIPAL_SCOPES:
        text = f"principal {principal_name(subject)}"
        if scope == Scope.PRINCIPAL_DAY:
            text += " per day"
    else:
        text = "all runs per day"
    return f"{text} ({period})" if period else text


def principal_name(subject: str) -> str:
    if subject == EVERY_PRINCIPAL:
        return "every principal"
    from django.contrib.auth import get_user_model

    try:
        user = get_user_model().objects.filter(pk=int(subject)).first()
    except ValueError:
        user = None
    return user.get_username() if user is not None else f"#{subject}"


def _resume_stopped(counter_ids: list[int], actor: Any) -> int:
    """Resume every run a cap stopped in these counters (the operator who made room is the
    one named); a run whose other scopes are still full stops again at its next check."""
    from runs.record.checkpoint import checkpoint
    from runs.record.runs import run_resume

    resumed = 0
    for run_id in list(
        SpendStop.objects.filter(counter_id__in=counter_ids).values_list("run_id", flat=True)
    ):
        with checkpoint(run_id, actor=actor.label, channel=actor.channel) as cp:
            SpendStop.objects.filter(run_id=run_id).delete()
            # read under the lock the checkpoint holds
            status, reason = Run.objects.filter(id=run_id).values_list("status", "reason_code")[0]
            if status == Run.Status.NEEDS_ATTENTION and reason == Run.Reason.BUDGET_EXHAUSTED:
                run_resume(cp, by=actor.label)
                resumed += 1
    return resumed


# --- the 80 % alert ----------------------------------------------------------------------------


def _marker(counter: SpendCounter, cap: CapLimit) -> str:
    cost, tokens = limit_of(counter, cap)
    return f"{cost}/{tokens}"


def _warn_if_crossed(cp: Any, counter: SpendCounter, cap: CapLimit, before: float) -> None:
    """The scope crossed the warning share of its limit with this reservation: once per
    limit (a top-up or a new cap arms it again), audited and alerted after the commit."""
    warn_at = settings.AGENTOPS["SPEND_WARN_AT"]
    share = _share(counter, cap)
    marker = _marker(counter, cap)
    if share < warn_at or counter.warned_at == marker:
        return
    from runs.audit.entries import audit_record

    SpendCounter.objects.filter(pk=counter.pk).update(warned_at=marker)
    counter.warned_at = marker
    detail = (
        f"Spend cap of {describe(counter)} is {share:.0%} used: {usage_text(counter, cap)}. "
        "Runs in this scope stop when it is all used; a top-up resumes them."
    )
    audit_record(
        action="spend.cap_warning",
        actor="system",
        channel="worker",
        object_type="spend_counter",
        object_id=counter.pk,
        after={"scope": counter.scope, "subject": counter.subject, "period": counter.period,
               "share": round(share, 4), "limit": marker},
    )  # fmt: skip
    cp.on_commit(lambda: _alert(counter.pk, marker, level=int(warn_at * 100), detail=detail))


def usage_text(counter: SpendCounter, cap: CapLimit) -> str:
    cost, tokens = limit_of(counter, cap)
    parts = []
    if cost is not None:
        parts.append(f"cost {counter.cost_used} used + {counter.cost_reserved} reserved of {cost}")
    if tokens is not None:
        parts.append(
            f"{counter.tokens_used} tokens used + {counter.tokens_reserved} reserved of {tokens}"
        )
    return "; ".join(parts)


def _alert(counter_id: int, marker: str, *, level: int, detail: str) -> None:
    """After the commit: one alert per scope, limit and level, emailed to operators."""
    from runs.alerts import alert_raise
    from runs.models import Alert

    try:
        alert_raise(
            cause=f"{Alert.Kind.SPEND_CAP}:{counter_id}:{marker}:{level}",
            kind=Alert.Kind.SPEND_CAP,
            detail=detail,
        )
    except Exception:
        # the alert is a notice: its failure must not fail the commit that already landed
        log.exception("the spend cap alert for counter %s could not be raised", counter_id)


# --- operators: caps, top-ups, settling what a crash cut off (audited) -------------------------


class InvalidCap(InvalidInput):
    """A cap an operator asked for that cannot be applied."""

    def __init__(self, message: str, fields: dict[str, list[str]] | None = None) -> None:
        super().__init__(message)
        self.fields = fields or {"non_field_errors": [message]}


class CapNotFound(NotFound):
    """No cap of that scope and subject."""


class UnknownSubject(InvalidCap):
    """No agent or user of that name: there is nothing to cap."""

    code = "not_found"
    status = 404


def _amount(value: Any, name: str) -> Decimal | None:
    if value is None or value == "":
        return None
    try:
        amount = Decimal(str(value))
    except (InvalidOperation, ValueError):
        raise InvalidCap(f"{name} must be a number", {name: ["must be a number"]}) from None
    if not amount.is_finite() or amount < 0 or amount >= _MAX_COST:
        raise InvalidCap(
            f"{name} must be at least 0 and below 10^6", {name: ["at least 0, below 10^6"]}
        )
    return amount.quantize(Decimal("0.000001"))


def _tokens(value: Any, name: str) -> int | None:
    if value is None or value == "":
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0 or value > 2**62:
        raise InvalidCap(f"{name} must be a whole number, at least 0", {name: ["at least 0"]})
    return value


def subject_of(scope: str, subject: str) -> str:
    """The stored subject for what an operator typed: an agent's name, a principal's
    username (or ``*``), nothing for everything per day."""
    subject = (subject or "").strip()
    if scope not in Scope.values:
        raise InvalidCap(
            f"unknown scope {scope!r}", {"scope": [f"one of {', '.join(Scope.values)}"]}
        )
    if scope == Scope.GLOBAL_DAY:
        return ""
    if scope == Scope.AGENT:
        from runs.registry import UnknownAgent, registry

        try:
            registry.agent(subject)
        except UnknownAgent:
            raise UnknownSubject(
                f"no agent named {subject!r}", {"subject": [f"no agent named {subject!r}"]}
            ) from None
        return subject
    if subject == EVERY_PRINCIPAL:
        return subject
    from django.contrib.auth import get_user_model

    user = get_user_model().objects.filter(username=subject).first()
    if user is None:
        raise UnknownSubject(
            f"no user named {subject!r}", {"subject": [f"no user named {subject!r} (or *)"]}
        )
    return str(user.pk)


def _cap_json(row: SpendCap | None) -> dict[str, Any] | None:
    if row is None:
        return None
    return {"max_cost": row.max_cost, "max_tokens": row.max_tokens, "reason": row.reason}


def _audit(action: str, actor: Any, request: Any, object_id: str, before: Any, after: Any):
    from runs.audit.entries import audit_record

    audit_record(
        action=action,
        actor=actor.label,
        channel=actor.channel,
        request=request,
        object_type="spend_cap",
        object_id=object_id,
        before=before,
        after=after,
    )


def spend_cap_set(
    *,
    scope: str,
    subject: str = "",
    max_cost: Any = None,
    max_tokens: Any = None,
    actor: Any,
    reason: str = "",
    request: Any = None,
) -> SpendCap:
    """An operator sets (or changes) a cap: every process applies it at its next claim.
    Runs it stopped that now have room are resumed. Audited (``spend.cap_set``)."""
    actor.require("runs.operate_run")
    stored = subject_of(scope, subject)
    cost = _amount(max_cost, "max_cost")
    tokens = _tokens(max_tokens, "max_tokens")
    with transaction.atomic():
        row = SpendCap.objects.select_for_update().filter(scope=scope, subject=stored).first()
        before = _cap_json(row)
        row = row or SpendCap(scope=scope, subject=stored)
        row.max_cost, row.max_tokens = cost, tokens
        row.set_by, row.reason = actor.label, reason
        row.save()
        _audit("spend.cap_set", actor, request, f"{scope}:{stored}", before, _cap_json(row))
    configcache.refresh()
    _resume_with_room(scope, stored, actor)
    return row


def spend_cap_remove(
    *, scope: str, subject: str = "", actor: Any, reason: str = "", request: Any = None
) -> bool:
    """An operator removes a cap: the runs it stopped resume. Audited
    (``spend.cap_removed``). False when there was none."""
    actor.require("runs.operate_run")
    stored = subject_of(scope, subject)
    with transaction.atomic():
        row = SpendCap.objects.select_for_update().filter(scope=scope, subject=stored).first()
        if row is None:
            return False
        before = _cap_json(row)
        row.delete()
        _audit("spend.cap_removed", actor, request, f"{scope}:{stored}", before, {"reason": reason})
    configcache.refresh()
    _resume_with_room(scope, stored, actor)
    return True


def _counters_of(scope: str, stored: str):
    query = SpendCounter.objects.filter(scope=scope)
    return query if stored == EVERY_PRINCIPAL else query.filter(subject=stored)


def _resume_with_room(scope: str, stored: str, actor: Any) -> int:
    """After a cap changed: the runs it stopped whose scope now has room go on."""
    room = []
    for counter in _counters_of(scope, stored).filter(stops__isnull=False).distinct():
        cap = cap_of(counter.scope, counter.subject)
        if cap is None or not reached(counter, cap):
            room.append(counter.pk)
    return _resume_stopped(room, actor) if room else 0


@dataclass(frozen=True)
class TopUp:
    counter: SpendCounter
    resumed: int


def spend_top_up(
    *,
    scope: str,
    subject: str = "",
    add_cost: Any = None,
    add_tokens: Any = None,
    actor: Any,
    reason: str = "",
    request: Any = None,
) -> TopUp:
    """An operator adds to a scope's limit for its current period (today, for a day scope):
    the cap itself is unchanged. Every run the scope stopped is resumed. Refused when the
    scope would still be full (``budget_exhausted``). Audited (``spend.topped_up``)."""
    from runs.services import BudgetExhausted

    actor.require("runs.operate_run")
    stored = subject_of(scope, subject)
    if stored == EVERY_PRINCIPAL:
        raise CapNotFound("a top-up is of one principal's scope: name the principal, not *")
    # nothing to add is allowed: it resumes the runs the scope stopped if it has room again
    cost = _amount(add_cost, "add_cost") or ZERO
    tokens = _tokens(add_tokens, "add_tokens") or 0
    configcache.refresh()
    cap = cap_of(scope, stored)
    if cap is None:
        raise CapNotFound(f"no cap on {scope} {subject}".strip())
    period = today() if scope in DAY_SCOPES else ""
    with transaction.atomic():
        (counter, _cap), = _lock_counters([(scope, stored, period, cap)])  # fmt: skip
        before = _counter_json(counter, cap)
        counter.cost_added += cost
        counter.tokens_added += tokens
        counter.save(update_fields=["cost_added", "tokens_added", "updated_at"])
        still = reached(counter, cap)
        if still:
            raise BudgetExhausted(f"the scope would still be full: {still}")
        _audit(
            "spend.topped_up",
            actor,
            request,
            f"{scope}:{stored}:{period}",
            before,
            _counter_json(counter, cap) | {"reason": reason},
        )
    return TopUp(counter, _resume_stopped([counter.pk], actor))


def _counter_json(counter: SpendCounter, cap: CapLimit) -> dict[str, Any]:
    cost, tokens = limit_of(counter, cap)
    return {
        "period": counter.period,
        "cost_used": counter.cost_used,
        "cost_reserved": counter.cost_reserved,
        "max_cost": cost,
        "tokens_used": counter.tokens_used,
        "tokens_reserved": counter.tokens_reserved,
        "max_tokens": tokens,
    }


def spend_reservation_settle(
    *, reservation_id: Any, cost: Any, tokens: Any, actor: Any, request: Any = None
) -> SpendReservation:
    """An operator settles a model request a crash cut off with its real usage (the
    provider's bill): the run's usage and the scopes' are corrected from the maximum that
    was charged to the real amounts. Recorded in the run (``spend.settled``)."""
    from runs.record.checkpoint import checkpoint

    actor.require("runs.operate_run")
    real_cost = _amount(cost, "cost")
    real_tokens = _tokens(tokens, "tokens")
    if real_cost is None or real_tokens is None:
        raise InvalidCap("give the real cost and tokens", {"cost": ["required"], "tokens": ["required"]})  # fmt: skip
    found = SpendReservation.objects.filter(pk=reservation_id).values_list("run_id", flat=True)
    run_id = found.first()
    if run_id is None:
        raise NotFound(f"no spend reservation {reservation_id}")
    with checkpoint(run_id, actor=actor.label, channel=actor.channel) as cp:
        reservation = SpendReservation.objects.select_for_update().get(pk=reservation_id)
        if reservation.state != SpendReservation.State.CUT_OFF:
            raise InvalidState(
                f"reservation {reservation_id} is {reservation.state}: only one a crash cut "
                "off is settled by an operator (a held one settles by itself)"
            )
        add_usage(cp, tokens=real_tokens - reservation.tokens, cost=real_cost - reservation.cost)
        cp.event(
            EventType.SPEND_SETTLED,
            reservation=reservation.pk,
            kind=reservation.kind,
            reserved={"cost": reservation.cost, "tokens": reservation.tokens},
            settled={"cost": real_cost, "tokens": real_tokens},
            by=actor.label,
        )
        settle(cp, reservation, cost=real_cost, tokens=real_tokens, by=actor.label)
    return reservation


# --- what the console, the API and /metrics show -----------------------------------------------


@dataclass(frozen=True)
class ScopeView:
    """One capped scope in its current period: used, reserved, the limit and what is left."""

    cap: SpendCap
    subject: str  # the counter's subject (a principal's id for a "*" cap's principals)
    subject_label: str
    period: str
    counter: SpendCounter | None
    stopped: int

    @property
    def scope(self) -> str:
        return self.cap.scope

    @property
    def label(self) -> str:
        return describe(self.counter or _Key(self.cap.scope, self.subject, self.period))

    def _get(self, name: str) -> Any:
        return getattr(self.counter, name) if self.counter is not None else 0

    @property
    def cost_used(self) -> Decimal:
        return self._get("cost_used") or ZERO

    @property
    def cost_reserved(self) -> Decimal:
        return self._get("cost_reserved") or ZERO

    @property
    def tokens_used(self) -> int:
        return self._get("tokens_used")

    @property
    def tokens_reserved(self) -> int:
        return self._get("tokens_reserved")

    @property
    def max_cost(self) -> Decimal | None:
        if self.cap.max_cost is None:
            return None
        return self.cap.max_cost + (self._get("cost_added") or ZERO)

    @property
    def max_tokens(self) -> int | None:
        if self.cap.max_tokens is None:
            return None
        return self.cap.max_tokens + self._get("tokens_added")

    @property
    def cost_left(self) -> Decimal | None:
        if self.max_cost is None:
            return None
        return max(self.max_cost - self.cost_used - self.cost_reserved, ZERO)

    @property
    def tokens_left(self) -> int | None:
        if self.max_tokens is None:
            return None
        return max(self.max_tokens - self.tokens_used - self.tokens_reserved, 0)

    @property
    def full(self) -> bool:
        return self.cost_left == 0 or self.tokens_left == 0

    @property
    def share(self) -> float:
        if self.counter is None:
            return 0.0
        return _share(self.counter, CapLimit(self.cap.max_cost, self.cap.max_tokens))


@dataclass(frozen=True)
class _Key:
    scope: str
    subject: str
    period: str


def scope_views(caps: list[SpendCap] | None = None) -> list[ScopeView]:
    """Every cap in its current period (a ``*`` cap: each principal it counted so far)."""
    from django.db.models import Count

    caps = list(SpendCap.objects.order_by("scope", "subject")) if caps is None else caps
    if not caps:
        return []
    day = today()
    wanted = Q()
    for cap in caps:
        period = day if cap.scope in DAY_SCOPES else ""
        if cap.subject == EVERY_PRINCIPAL:
            wanted |= Q(scope=cap.scope, period=period)
        else:
            wanted |= Q(scope=cap.scope, subject=cap.subject, period=period)
    counters = {
        (c.scope, c.subject, c.period): c
        for c in SpendCounter.objects.filter(wanted).annotate(
            # runs still stopped (one terminated since is no longer waiting for a top-up)
            stopped=Count("stops", filter=Q(stops__run__status=Run.Status.NEEDS_ATTENTION))
        )
    }
    names = _usernames(
        {c.subject for c in caps if c.scope in PRINCIPAL_SCOPES}
        | {s for (scope, s, _p) in counters if scope in PRINCIPAL_SCOPES}
    )
    views = []
    own = {(c.scope, c.subject) for c in caps}
    for cap in caps:
        period = day if cap.scope in DAY_SCOPES else ""
        if cap.subject == EVERY_PRINCIPAL:
            subjects = sorted(
                s
                for (scope, s, p) in counters
                if scope == cap.scope and p == period and (scope, s) not in own
            )
        else:
            subjects = [cap.subject]
        if cap.subject == EVERY_PRINCIPAL and not subjects:
            views.append(ScopeView(cap, cap.subject, "every principal", period, None, 0))
        for subject in subjects:
            counter = counters.get((cap.scope, subject, period))
            views.append(
                ScopeView(
                    cap,
                    subject,
                    names.get(subject, subject) if cap.scope in PRINCIPAL_SCOPES else subject,
                    period,
                    counter,
                    getattr(counter, "stopped", 0) if counter is not None else 0,
                )
            )
    return views


def _usernames(ids: set[str]) -> dict[str, str]:
    from django.contrib.auth import get_user_model

    numbers = [int(i) for i in ids if i.isdigit()]
    if not numbers:
        return {EVERY_PRINCIPAL: "every principal"}
    users = get_user_model().objects.filter(pk__in=numbers)
    return {str(u.pk): u.get_username() for u in users} | {EVERY_PRINCIPAL: "every principal"}


def cut_off_reservations(limit: int = 100) -> list[SpendReservation]:
    """Model requests a crash cut off, charged at their maximum until an operator settles
    them."""
    return list(
        SpendReservation.objects.filter(state=SpendReservation.State.CUT_OFF)
        .select_related("run")
        .order_by("-created_at")[:limit]
    )


def collect_metrics():
    """Spend by capped scope in its current period: used, reserved, the limit (money and
    tokens), and model requests cut off by a crash still to settle."""
    from prometheus_client.core import GaugeMetricFamily

    labels = ["scope", "subject", "period"]
    families = {
        name: GaugeMetricFamily(f"agentops_spend_{name}", text, labels=labels)
        for name, text in (
            ("cost_used", "Settled spend of a capped scope in its current period."),
            ("cost_reserved", "Spend reserved by calls in flight (and cut off) in the scope."),
            ("cost_cap", "The scope's cost limit in its period (cap plus top-ups)."),
            ("tokens_used", "Settled tokens of a capped scope in its current period."),
            ("tokens_reserved", "Tokens reserved by calls in flight (and cut off)."),
            ("tokens_cap", "The scope's token limit in its period (cap plus top-ups)."),
        )
    }
    for view in scope_views():
        key = [view.scope, view.subject_label, view.period]
        families["cost_used"].add_metric(key, float(view.cost_used))
        families["cost_reserved"].add_metric(key, float(view.cost_reserved))
        families["tokens_used"].add_metric(key, view.tokens_used)
        families["tokens_reserved"].add_metric(key, view.tokens_reserved)
        if view.max_cost is not None:
            families["cost_cap"].add_metric(key, float(view.max_cost))
        if view.max_tokens is not None:
            families["tokens_cap"].add_metric(key, view.max_tokens)
    cut = GaugeMetricFamily(
        "agentops_spend_cut_off_reservations",
        "Model requests a crash cut off, charged at their maximum until an operator settles them.",
    )
    cut.add_metric(
        [], SpendReservation.objects.filter(state=SpendReservation.State.CUT_OFF).count()
    )
    yield from (*families.values(), cut)

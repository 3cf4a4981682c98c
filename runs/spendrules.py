"""What the record's own writes need of the spend caps: ``runs.spend``'s rules below the record
(``runs.spend`` holds the services above it: caps, top-ups, alerts, parking runs). Which caps
exist (re-read when the claim statement reports that they changed:
``runs.record.configcache``), the scopes a run counts in, and settling a reservation in the
commit that learns the real usage (``settle``; a tool call's at its receipt or cancellation:
``settle_call``, called by ``runs.record.transitions``). Of ``runs`` it imports only the
models, the registry and the configuration cache.
"""

from __future__ import annotations

import zoneinfo
from dataclasses import dataclass
from datetime import datetime
from decimal import Decimal
from typing import Any

from django.conf import settings
from django.db.models import F
from django.utils import timezone

from runs.models import Run, SpendCap, SpendCounter, SpendReservation
from runs.record import configcache

Scope = SpendCap.Scope
EVERY_PRINCIPAL = "*"
DAY_SCOPES = (Scope.PRINCIPAL_DAY, Scope.GLOBAL_DAY)
PRINCIPAL_SCOPES = (Scope.PRINCIPAL, Scope.PRINCIPAL_DAY)
ZERO = Decimal(0)


@dataclass(frozen=True)
class CapLimit:
    max_cost: Decimal | None
    max_tokens: int | None


# --- which caps exist (in-process, no query on the hot path) ----------------------------------


def _read_caps(generation: str | None) -> dict[tuple[str, str], CapLimit]:
    if generation is not None and generation.startswith("0:"):
        return {}  # no rows: no query
    return {
        (row.scope, row.subject): CapLimit(row.max_cost, row.max_tokens)
        for row in SpendCap.objects.all()
    }


# the operators' caps, re-read when the claim statement reports that they changed
caps_configured = configcache.register(
    "spend_caps",
    generation_sql=configcache.rows_generation_sql(SpendCap._meta.db_table),
    read=_read_caps,
)


def active() -> bool:
    """Whether any cap is configured (as this process last saw it)."""
    return bool(caps_configured.get())


def _zone() -> zoneinfo.ZoneInfo:
    return zoneinfo.ZoneInfo(settings.AGENTOPS["SPEND_TIME_ZONE"])


def today(now: datetime | None = None) -> str:
    """The day caps count now: its date in the configured time zone."""
    return (now or timezone.now()).astimezone(_zone()).date().isoformat()


def cap_of(scope: str, subject: str) -> CapLimit | None:
    cap = caps_configured.get().get((scope, subject))
    if cap is None and scope in PRINCIPAL_SCOPES:
        cap = caps_configured.get().get((scope, EVERY_PRINCIPAL))
    return cap


def scopes_of(run: Run, now: datetime | None = None) -> list[tuple[str, str, str, CapLimit]]:
    """The capped scopes a run counts in now: (scope, subject, period, cap). None for a dry
    run or with no caps (no query)."""
    if not caps_configured.get() or run.dry_run:
        return []
    found = []
    day = None
    cap = caps_configured.get().get((Scope.AGENT, run.agent_name))
    if cap is not None:
        found.append((Scope.AGENT, run.agent_name, "", cap))
    if run.principal_id is not None:
        principal = str(run.principal_id)
        cap = cap_of(Scope.PRINCIPAL, principal)
        if cap is not None:
            found.append((Scope.PRINCIPAL, principal, "", cap))
        cap = cap_of(Scope.PRINCIPAL_DAY, principal)
        if cap is not None:
            day = day or today(now)
            found.append((Scope.PRINCIPAL_DAY, principal, day, cap))
    cap = caps_configured.get().get((Scope.GLOBAL_DAY, ""))
    if cap is not None:
        found.append((Scope.GLOBAL_DAY, "", day or today(now), cap))
    return found


def applies(run: Run) -> bool:
    """Whether a cap covers this run (in-process: no query)."""
    return bool(caps_configured.get()) and bool(scopes_of(run))


def release(counter_ids: list[int], *, reserved: tuple[Decimal, int], used: tuple[Decimal, int]):
    """Move a settled reservation from the counters' reserved to their used."""
    if not counter_ids:
        return
    SpendCounter.objects.filter(pk__in=counter_ids).update(
        cost_reserved=F("cost_reserved") - reserved[0],
        tokens_reserved=F("tokens_reserved") - reserved[1],
        cost_used=F("cost_used") + used[0],
        tokens_used=F("tokens_used") + used[1],
    )


def settle(cp: Any, reservation: SpendReservation, *, cost: Decimal, tokens: int, by: str) -> None:
    """The real usage of a reserved call is known (in the commit that learns it): the
    reservation is settled and its scopes charged with the real usage instead."""
    reservation.state = SpendReservation.State.SETTLED
    reservation.cost_settled = cost
    reservation.tokens_settled = tokens
    reservation.settled_at = timezone.now()
    reservation.settled_by = by
    cp.save_fields(
        reservation, ["state", "cost_settled", "tokens_settled", "settled_at", "settled_by"]
    )
    release(
        reservation.counters, reserved=(reservation.cost, reservation.tokens), used=(cost, tokens)
    )


def declared(tool_name: str) -> tuple[Decimal, int]:
    from runs.registry import UnknownTool, registry

    try:
        tool = registry.tool(tool_name)
    except UnknownTool:
        return ZERO, 0
    return tool.max_cost or ZERO, tool.max_tokens or 0


def settle_call(cp: Any, call: Any, *, ok: bool) -> None:
    """A call's receipt (or its cancellation: ``ok`` False) in the commit ``cp``: its
    reservation, if it has one, is settled — at the declared cost for a call that succeeded,
    nothing for one that failed or never left. Only tools that declare a cost ever hold one:
    for every other tool this costs nothing (no query)."""
    if call.pk is None:
        return
    cost, tokens = declared(call.tool_name)
    if not (cost or tokens):
        return
    held = SpendReservation.objects.filter(
        tool_call_id=call.pk, state=SpendReservation.State.HELD
    ).first()
    if held is not None:
        settle(
            cp,
            held,
            cost=held.cost if ok else ZERO,
            tokens=held.tokens if ok else 0,
            by=cp.actor,
        )

# size: one concern, the limits of a tool (acquire in the dispatching transaction, the durable
# line of waiters and its fair wake-ups, the operators' services): split, acquire and wake would
# read across modules every rule they share (issue 26 left a split by side as a follow-up)
"""Flow control: per-tool limits shared by every worker (DESIGN §9, docs/agents.md "Limits").

A tool may declare ``Limits`` (``Tool.limits``) and an operator may set one at run time
(``runs.models.ToolLimit``, ``tool_limit_set``): at most N calls in flight, and a rate with a
burst, optionally one limit per value of an argument. The limit is enforced in the
``dispatching`` transaction (``acquire``): the tool's ``ToolCapacity`` row is locked, the calls
in flight are counted from the record itself — ``dispatching`` or ``unknown`` calls whose
landing deadline is still ahead, so a slot is held until the receipt or the landing
deadline, whichever comes first, and a crash can never leak one — and the rate limiter's
state (GCRA) is advanced. Every worker on every machine locks the same row: one limit.

A call over the limit waits durably (``await_capacity``): its decision is kept, the run is
released (``queued``, no lease, a late fallback ``wake_at``) and listed in ``ToolWaiter``.
When a slot frees — a receipt, a dispatch that leaves room, the sweeper — the next waiters
are woken in fair order: the principal served longest ago first, then the oldest waiter
(round robin across principals, ``ToolShare``). A newcomer never jumps the line.

With no limit on a tool nothing here runs: the hot path's statements do not change. Which
tools are limited is known in-process: the declared limits are code, and the operators'
rows are re-read only when the claim statement reports that they changed
(``runs.record.configcache``).
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from django.db import connection, transaction
from django.db.models import Exists, F, OuterRef, Subquery, Value, Window
from django.db.models.functions import Coalesce, Now, RowNumber

from runs.errors import DomainError, InvalidInput
from runs.models import (
    AgentManifest,
    Run,
    ToolCall,
    ToolCapacity,
    ToolLimit,
    ToolShare,
    ToolWaiter,
)
from runs.record import configcache
from runs.record.eventtypes import EventType
from runs.registry import Limits, Tool

log = logging.getLogger(__name__)

# a waiter not woken by anyone looks again after this long (a lost wake-up costs this much)
FALLBACK_SECONDS = 30.0
WAITING_PREFIX = "waiting for capacity on "
_IN_LINE = (Run.Status.QUEUED, Run.Status.RUNNING)
# a call in one of these holds a slot until its landing deadline
_HOLDING = (ToolCall.Status.DISPATCHING, ToolCall.Status.UNKNOWN)


# --- which tools are limited (in-process, no query on the hot path) ---------------------------


def _read_operator_limits(generation: str | None) -> dict[str, Limits]:
    if generation is not None and generation.startswith("0:"):
        return {}  # no rows: no query
    return {row.tool_name: limits_of(row) for row in ToolLimit.objects.all()}


# the operators' rows, re-read when the claim statement reports that they changed
_operator_limits = configcache.register(
    "tool_limits",
    generation_sql=configcache.rows_generation_sql(ToolLimit._meta.db_table),
    read=_read_operator_limits,
)


def limits_of(row: ToolLimit) -> Limits:
    return Limits(
        max_in_flight=row.max_in_flight,
        rate=row.rate,
        per_seconds=row.per_seconds or 1.0,
        burst=row.burst,
        key_argument=row.key_argument,
    )


def limit_for(tool: Tool | None) -> Limits | None:
    """The limit that applies to ``tool`` now: an operator's, else the tool's own; None when
    nothing binds."""
    if tool is None:
        return None
    limits = _operator_limits.get().get(tool.name, tool.limits)
    return limits if limits is not None and limits.binding else None


def limit_for_name(tool_name: str) -> Limits | None:
    from runs.registry import UnknownTool, registry

    try:
        return limit_for(registry.tool(tool_name))
    except UnknownTool:
        limits = _operator_limits.get().get(tool_name)
        return limits if limits is not None and limits.binding else None


# --- the dispatch's check ---------------------------------------------------------------------


class AtCapacity(DomainError):
    """The call would exceed its tool's limit: it is not dispatched now."""

    code = "at_capacity"
    status = 429

    def __init__(self, tool: str, key: str, *, retry_at: datetime, now: datetime, why: str):
        self.tool, self.key, self.retry_at, self.now, self.why = tool, key, retry_at, now, why
        super().__init__(f"{WAITING_PREFIX}{tool}: {why}")

    @property
    def retry_after(self) -> float:
        return max((self.retry_at - self.now).total_seconds(), 0.0)

    @property
    def extra(self) -> dict[str, Any]:
        """What a remote agent acts on (the API's body): when to try again."""
        return {"tool": self.tool, "retry_after": round(max(self.retry_after, 0.05), 3)}


@dataclass
class _Capacity:
    pk: int  # the ToolCapacity row's, locked by this transaction
    grants: int
    tat: datetime | None
    now: datetime
    in_flight: int
    free: int  # slots free (a large number with no concurrency limit)
    tokens: int  # calls the rate allows now (a large number with no rate)
    next_token_at: datetime  # when the rate allows the next call after those
    anyone_waits: bool  # a ToolWaiter of this limit exists
    run_waits: bool  # the run asked about has a ToolWaiter (of any limit)
    share_pk: int | None  # the run's principal's ToolShare row of this limit, if any


def share_of(run: Run) -> str:
    """The unit of the fair share: the principal the run acts as."""
    return f"user:{run.principal_id}" if run.principal_id is not None else ""


def _key_value(limits: Limits, key: str, arguments: Any) -> Any:
    """The argument's JSON value a keyed limit counts by (a number stays a number)."""
    return arguments.get(limits.key_argument) if isinstance(arguments, dict) else key


def _holding(tool_name: str, limits: Limits, key: str, arguments: Any, now: Any):
    """Calls of the tool (with this key) that hold a slot: dispatched, no receipt yet, and
    their landing deadline still ahead (``now``: the database's clock)."""
    query = ToolCall.objects.filter(
        tool_name=tool_name,
        status__in=_HOLDING,
        landing_deadline__gt=now if now is not None else Now(),
    )
    if limits.key_argument:
        query = query.filter(
            **{f"arguments__{limits.key_argument}": _key_value(limits, key, arguments)}
        )
    return query


def in_flight(tool_name: str, limits: Limits, key: str = "", now: Any = None) -> int:
    return _holding(tool_name, limits, key, None, now).count()


def _capacity(
    tool_name: str,
    limits: Limits,
    key: str,
    arguments: Any = None,
    *,
    run_id: Any = None,
    share: str | None = None,
) -> _Capacity:
    """Lock the tool's capacity row (created at its first use) and read what is free, who
    waits, and (``run_id``, ``share``) whether that run waits and its principal's share row.

    Two statements on PostgreSQL, in this order for a reason: the first upserts and locks
    the row; the second counts the calls in flight in a snapshot taken AFTER the lock was
    granted (READ COMMITTED: each statement sees what committed before it began), so it
    sees the dispatch of whoever held the lock before — counting in the locking statement
    itself would read a snapshot from before the wait and could give one slot twice."""
    if connection.vendor == "postgresql":
        pk, grants, tat, now = _lock_row_sql(tool_name, key)
        busy, anyone, mine, share_pk = _look_sql(
            tool_name, limits, key, arguments, now, run_id=run_id, share=share
        )
    else:
        ToolCapacity.objects.bulk_create(
            [ToolCapacity(tool_name=tool_name, limit_key=key)], ignore_conflicts=True
        )
        row = (
            ToolCapacity.objects.select_for_update()
            .annotate(db_now=Now())
            .get(tool_name=tool_name, limit_key=key)
        )
        pk, grants, tat, now = row.pk, row.grants, row.tat, row.db_now
        busy = 0
        if limits.max_in_flight is not None:
            busy = _holding(tool_name, limits, key, arguments, now).count()
        anyone = _anyone_waits(tool_name, key)
        mine = run_id is not None and ToolWaiter.objects.filter(run_id=run_id).exists()
        share_pk = None
        if share is not None:
            share_pk = (
                ToolShare.objects.filter(tool_name=tool_name, limit_key=key, share=share)
                .values_list("pk", flat=True)
                .first()
            )
    many = 1 << 30
    free = many
    if limits.max_in_flight is not None:
        free = max(limits.max_in_flight - busy, 0)
    tokens, next_token_at = many, now
    if limits.rate is not None:
        tokens, next_token_at = _gcra_tokens(tat, now, limits)
    return _Capacity(
        pk, grants, tat, now, busy, free, tokens, next_token_at, anyone, mine, share_pk
    )


# literal SQL of the capacity statements on PostgreSQL, by shape (built once per process)
_sql: dict[Any, str] = {}


def _quote(name: str) -> str:
    return connection.ops.quote_name(name)


def _table(model: Any) -> str:
    return _quote(model._meta.db_table)


def _column(model: Any, name: str) -> str:
    return _quote(model._meta.get_field(name).column)


def _lock_row_sql(tool_name: str, key: str) -> tuple[int, int, datetime | None, datetime]:
    """ONE statement: the capacity row inserted at the limit's first use, else locked (a
    no-op ``DO UPDATE`` locks the row as ``SELECT … FOR UPDATE`` would); returns its id,
    grants, rate state and the database's time."""
    if "lock" not in _sql:
        table = _table(ToolCapacity)
        tool, limit_key, grants = (
            _column(ToolCapacity, name) for name in ("tool_name", "limit_key", "grants")
        )
        _sql["lock"] = (
            f"INSERT INTO {table} ({tool}, {limit_key}, {grants}) VALUES (%s, %s, 0) "
            f"ON CONFLICT ({tool}, {limit_key}) DO UPDATE SET {grants} = {table}.{grants} "
            f"RETURNING {_column(ToolCapacity, 'id')}, {grants}, "
            f"{_column(ToolCapacity, 'tat')}, STATEMENT_TIMESTAMP()"
        )
    with connection.cursor() as cursor:
        cursor.execute(_sql["lock"], [tool_name, key])
        pk, grants, tat, now = cursor.fetchone()
    return pk, grants, tat, now


def _look_sql(
    tool_name: str,
    limits: Limits,
    key: str,
    arguments: Any,
    now: datetime,
    *,
    run_id: Any,
    share: str | None,
) -> tuple[int, bool, bool, int | None]:
    """ONE statement, after the lock: the calls holding a slot (``_holding``), whether
    anyone waits for this limit, whether ``run_id`` waits, and ``share``'s row."""
    keyed = bool(limits.key_argument)
    shape = ("look", keyed)
    if shape not in _sql:
        calls, waiters, shares = _table(ToolCall), _table(ToolWaiter), _table(ToolShare)
        held = (
            f"SELECT count(*) FROM {calls} WHERE {_column(ToolCall, 'tool_name')} = %s "
            f"AND {_column(ToolCall, 'status')} IN (%s, %s) "
            f"AND {_column(ToolCall, 'landing_deadline')} > %s"
        )
        if keyed:
            # as the ORM's ``arguments__<key>=value``: the argument's JSON value
            held += f" AND ({_column(ToolCall, 'arguments')} -> %s) = %s::jsonb"
        waiter_tool, waiter_key = (_column(ToolWaiter, name) for name in ("tool_name", "limit_key"))
        _sql[shape] = (
            f"SELECT ({held}), "
            f"EXISTS (SELECT 1 FROM {waiters} WHERE {waiter_tool} = %s AND {waiter_key} = %s), "
            f"EXISTS (SELECT 1 FROM {waiters} WHERE {_column(ToolWaiter, 'run')} = %s), "
            f"(SELECT {_column(ToolShare, 'id')} FROM {shares} "
            f"WHERE {_column(ToolShare, 'tool_name')} = %s "
            f"AND {_column(ToolShare, 'limit_key')} = %s AND {_column(ToolShare, 'share')} = %s)"
        )
    params: list[Any] = [tool_name, *(status.value for status in _HOLDING), now]
    if keyed:
        params += [limits.key_argument, json.dumps(_key_value(limits, key, arguments))]
    params += [tool_name, key, run_id, tool_name, key, share]
    with connection.cursor() as cursor:
        cursor.execute(_sql[shape], params)
        busy, anyone, mine, share_pk = cursor.fetchone()
    return busy, bool(anyone), bool(mine), share_pk


def _gcra_tokens(tat: datetime | None, now: datetime, limits: Limits) -> tuple[int, datetime]:
    """GCRA: how many calls the rate allows at ``now``, and when the next one after them is
    allowed. ``tat`` (theoretical arrival time) is ``now`` or later once calls were made."""
    interval = timedelta(seconds=limits.interval)
    burst = limits.burst or 1
    tat = max(tat or now, now)
    # a call is allowed while tat - now <= (burst - 1) * interval
    room = (burst - 1) * limits.interval - (tat - now).total_seconds()
    tokens = 0 if room < -1e-9 else min(burst, int(math.floor(room / limits.interval + 1e-9)) + 1)
    next_at = tat - (burst - 1) * interval + tokens * interval
    return tokens, next_at


def acquire(cp: Any, *, run: Run, call: ToolCall, tool_name: str, limits: Limits) -> None:
    """In the ``dispatching`` transaction, before the call moves: take a slot (and a token),
    or raise ``AtCapacity`` having written nothing but the capacity row's first insert (the
    caller rolls back, or records the wait in the same commit). Waiters go first, in fair
    order: a call that finds room while others wait for it waits its turn (and the ones
    whose turn it is are woken).

    A limit that does not bind costs two statements here (lock, look); the grant itself is
    written by the checkpoint's own statement (``cp.update_row``), and the waiter and share
    rows are touched only when there is something to change."""
    # the run is locked first (the checkpoint's transaction begins here): the capacity
    # row's upsert below must not open a transaction of its own before it
    cp.lock()
    key = limits.key_of(call.arguments)
    share = share_of(run)
    cap = _capacity(tool_name, limits, key, call.arguments, run_id=run.id, share=share)
    room = min(cap.free, cap.tokens)
    if room <= 0:
        if cap.free <= 0:
            why = f"{cap.in_flight} of {limits.max_in_flight} calls in flight"
            retry_at = _earliest_release(tool_name, limits, key, call.arguments, cap.now)
        else:
            why = f"rate {limits.describe()}"
            retry_at = cap.next_token_at
        raise AtCapacity(tool_name, key, retry_at=retry_at, now=cap.now, why=why)
    turn = _next_waiters(tool_name, key, room) if cap.anyone_waits else []
    if turn and run.id not in turn:
        raise AtCapacity(
            tool_name,
            key,
            retry_at=cap.now,
            now=cap.now,
            why=f"{len(turn)} waiting run(s) go first (fair share)",
        )
    # a slot and a token: the call is dispatched in this transaction, and the grant is
    # written with it (the capacity row stays locked until that commit)
    grants = cap.grants + 1
    tat = cap.tat
    if limits.rate is not None:
        tat = max(cap.tat or cap.now, cap.now) + timedelta(seconds=limits.interval)
    cp.update_row(ToolCapacity, cap.pk, grants=grants, tat=tat)
    if cap.share_pk is not None:
        cp.update_row(ToolShare, cap.share_pk, last_grant=grants)
    else:
        # the principal's first grant on this limit: its row from now on (once, ever)
        ToolShare.objects.create(tool_name=tool_name, limit_key=key, share=share, last_grant=grants)
    if cap.run_waits:
        ToolWaiter.objects.filter(run_id=run.id).delete()
    if run.reason_detail.startswith(WAITING_PREFIX):
        cp.update(reason_detail="")
        run.reason_detail = ""
    cp.event(EventType.TOOL_CAPACITY_GRANTED, tool=tool_name, key=key, in_flight=cap.in_flight + 1)
    if cap.anyone_waits and (room > 1 or limits.rate is not None):
        # room left for others, or the next token's time is known: wake whoever is next.
        # With nobody waiting under the lock, nobody is to wake: a waiter listed after this
        # look wakes the line itself after its own commit (``wait_commit``), and its look at
        # the capacity row waits for this transaction's lock, so it counts this dispatch
        transaction.on_commit(lambda: wake(tool_name, key))


def _earliest_release(
    tool_name: str, limits: Limits, key: str, arguments: Any, now: datetime
) -> datetime:
    """When a slot frees at the latest: the earliest landing deadline in flight."""
    query = _holding(tool_name, limits, key, arguments, now).order_by("landing_deadline")
    return query.values_list("landing_deadline", flat=True).first() or now


def _line(tool_name: str, key: str):
    """The waiters of one limit in fair order: each principal's oldest waiter first, the
    principal served longest ago first among them (round robin), then arrival."""
    served = ToolShare.objects.filter(
        tool_name=OuterRef("tool_name"), limit_key=OuterRef("limit_key"), share=OuterRef("share")
    ).values("last_grant")[:1]
    return (
        # a waiter that was woken holds its place while it claims and dispatches (running),
        # as long as the call it waits to dispatch is still open (a call cancelled or settled
        # meanwhile — a changed tool, an operator — gives its place up)
        ToolWaiter.objects.filter(
            Exists(_waited_call()), tool_name=tool_name, limit_key=key, run__status__in=_IN_LINE
        )
        # a remote agent's run waits in line while its process holds the lease and retries
        # (``join_line``); one whose lease expired (queued, no process) holds no place
        .exclude(
            run__status=Run.Status.QUEUED,
            run__agent_name__in=AgentManifest.objects.values("name"),
        )
        .annotate(
            place=Window(RowNumber(), partition_by=[F("share")], order_by=F("id").asc()),
            served=Coalesce(Subquery(served), Value(0)),
        )
        .order_by("place", "served", "id")
    )


def _waited_call():
    return ToolCall.objects.filter(
        run_id=OuterRef("run_id"),
        tool_name=OuterRef("tool_name"),
        status__in=(ToolCall.Status.PROPOSED, ToolCall.Status.APPROVED, ToolCall.Status.UNKNOWN),
    )


def _next_waiters(tool_name: str, key: str, count: int) -> list[Any]:
    """The run ids whose turn it is for ``count`` slots."""
    return [waiter.run_id for waiter in _line(tool_name, key)[:count]]


def _anyone_waits(tool_name: str, key: str) -> bool:
    """The usual case of a limit that does not bind is nobody waiting: one plain look, where
    the fair line is a window query to compile and run."""
    return ToolWaiter.objects.filter(tool_name=tool_name, limit_key=key).exists()


# --- waiting and waking -----------------------------------------------------------------------


def wait_commit(cp: Any, *, run: Run, call: ToolCall, seq: int, full: AtCapacity) -> None:
    """The run waits for capacity: listed as a waiter, released without a lease, with a late
    fallback ``wake_at`` (woken earlier when its turn comes)."""
    from runs.record.runs import run_await_capacity

    cp.lock()  # update_or_create opens a transaction of its own
    # a run keeps its place in line while it waits again (woken, then deferred once more)
    ToolWaiter.objects.update_or_create(
        run_id=run.id,
        defaults={"tool_name": full.tool, "limit_key": full.key, "share": share_of(run)},
    )
    fallback = full.now + timedelta(seconds=FALLBACK_SECONDS)
    run_await_capacity(
        cp,
        tool=full.tool,
        key=full.key,
        seq=seq,
        why=full.why,
        wake_at=fallback,
    )
    run.reason_detail = f"{WAITING_PREFIX}{full.tool}"
    # the waiters whose turn it is may be due now (a fair-share deferral, a freed slot)
    transaction.on_commit(lambda: wake(full.tool, full.key))


def join_line(run: Run, full: AtCapacity) -> None:
    """A remote agent's dispatch found its tool full: the run takes its place in the fair
    line as a hosted run would (its process keeps the lease and dispatches again after
    ``retry_after``; its turn is kept for it when it comes). Outside the dispatch's
    transaction, which was rolled back."""
    ToolWaiter.objects.update_or_create(
        run_id=run.id,
        defaults={"tool_name": full.tool, "limit_key": full.key, "share": share_of(run)},
    )


# the runs this task process woke for a slot free now (``handing_over``): advanced by this
# same process right after its slice, rather than after a queue's poll and another claim
_handed_over: dict[Any, None] | None = None


@contextmanager
def handing_over() -> Iterator[None]:
    """Inside a task (``runs.tasks.advance_run``): remember the runs ``wake`` woke for a
    free slot, for ``take_handed_over``. Each is still enqueued as usual (another worker may
    take it first — its claim then finds the lease taken — and a process that dies here
    loses nothing)."""
    global _handed_over
    _handed_over = {}
    try:
        yield
    finally:
        _handed_over = None


def take_handed_over() -> Any:
    """The oldest run this task woke and has not advanced yet (None: none)."""
    if not _handed_over:
        return None
    run_id = next(iter(_handed_over))
    del _handed_over[run_id]
    return run_id


def wake(tool_name: str, key: str) -> int:
    """Wake the waiters whose turn it is, as many as there is room for now (or, for a rate,
    at the times its next tokens come). Holds no lock: each waiter's ``wake_at`` is brought
    forward in its own statement, and a duplicate wake-up finds the lease taken."""
    from runs.queue import enqueue_run
    from runs.record.runs import run_wake_waiting

    if not _anyone_waits(tool_name, key):
        # nobody waits: nothing to lock or rank. No wake-up is lost by not looking further —
        # a waiter is listed in its own commit and wakes the line itself right after it
        # (``wait_commit``), so a waiter this statement did not see reads capacity after
        # whatever freed it had committed
        return 0
    limits = limit_for_name(tool_name)
    if limits is None:
        # the limit was removed: everyone waiting may go
        turn = list(
            ToolWaiter.objects.filter(tool_name=tool_name, limit_key=key).values_list(
                "run_id", flat=True
            )
        )
        times = [None] * len(turn)
    else:
        with transaction.atomic():
            cap = _capacity(tool_name, limits, key)
            room = cap.free
            if limits.rate is not None:
                # the tokens available now, then the next one at its time
                room = min(room, max(cap.tokens, 1))
            turn = _next_waiters(tool_name, key, room) if room > 0 else []
            times = []
            for index in range(len(turn)):
                if limits.rate is not None and index >= cap.tokens:
                    offset = (index - cap.tokens) * limits.interval
                    times.append(cap.next_token_at + timedelta(seconds=offset))
                else:
                    times.append(None)
    woken = 0
    for run_id, at in zip(turn, times, strict=True):
        if run_wake_waiting(run_id, at=at):
            woken += 1
            if at is None:
                enqueue_run(run_id)
                if _handed_over is not None:
                    _handed_over[run_id] = None
    return woken


def sweep_waiters() -> None:
    """Sweeper hook: wake the waiters whose turn came without anyone noticing (a landing
    deadline passed, a remote agent's receipt, an operator's resolution, a rate's next
    token, a lost wake-up), and forget waiters whose run no longer waits."""
    if not ToolWaiter.objects.exists():
        return
    configcache.refresh()
    ToolWaiter.objects.exclude(run__status__in=_IN_LINE).delete()
    ToolWaiter.objects.exclude(Exists(_waited_call())).delete()
    for tool_name, key in (
        ToolWaiter.objects.values_list("tool_name", "limit_key").distinct().order_by()
    ):
        try:
            wake(tool_name, key)
        except Exception:
            log.exception("waking the waiters for capacity on %s failed", tool_name)


def waiting_counts() -> dict[str, int]:
    """Runs waiting for capacity, by tool (metrics)."""
    from django.db.models import Count

    return dict(
        ToolWaiter.objects.filter(run__status=Run.Status.QUEUED)
        .values_list("tool_name")
        .annotate(n=Count("id"))
        .order_by()
    )


# --- operators' limits (audited) --------------------------------------------------------------


class InvalidLimit(InvalidInput):
    """A limit an operator asked for that cannot be applied."""

    def __init__(self, message: str, fields: dict[str, list[str]] | None = None) -> None:
        super().__init__(message)
        self.fields = fields


class UnknownToolName(InvalidLimit):
    """No tool of that name is registered: there is nothing to limit."""

    code = "not_found"
    status = 404


LIMIT_FIELDS = ("max_in_flight", "rate", "per_seconds", "burst", "key_argument")


def _known_tool(tool_name: str) -> Tool | None:
    from runs.registry import UnknownTool, registry

    try:
        return registry.tool(tool_name)
    except UnknownTool:
        return None


def _as_json(row: ToolLimit | None) -> dict[str, Any] | None:
    if row is None:
        return None
    return {name: getattr(row, name) for name in LIMIT_FIELDS} | {"reason": row.reason}


def tool_limit_set(
    *,
    tool_name: str,
    actor: Any,
    max_in_flight: int | None = None,
    rate: float | None = None,
    per_seconds: float = 1.0,
    burst: int | None = None,
    key_argument: str = "",
    reason: str = "",
    request: Any = None,
) -> ToolLimit:
    """An operator sets (or changes) a tool's limit at run time: it replaces the tool's own
    declaration in every process at their next claim (one with neither a maximum in flight
    nor a rate lifts the declared limit until it is removed), and the runs waiting for capacity on
    the tool are looked at again. Audited (``tool.limit_set``, before and after)."""
    actor.require("runs.operate_run")
    if _known_tool(tool_name) is None:
        raise UnknownToolName(
            f"no tool named {tool_name!r}", {"tool_name": [f"no tool named {tool_name!r}"]}
        )
    try:
        limits = Limits(
            max_in_flight=max_in_flight,
            rate=rate,
            per_seconds=per_seconds,
            burst=burst,
            key_argument=key_argument or "",
        )
    except ValueError as exc:
        raise InvalidLimit(str(exc)) from exc
    with transaction.atomic():
        row = ToolLimit.objects.select_for_update().filter(tool_name=tool_name).first()
        before = _as_json(row)
        row = row or ToolLimit(tool_name=tool_name)
        for name in LIMIT_FIELDS:
            setattr(row, name, getattr(limits, name))
        row.set_by = actor.label
        row.reason = reason
        row.save()
        _changed("tool.limit_set", actor, request, tool_name, before, _as_json(row))
    return row


def tool_limit_remove(*, tool_name: str, actor: Any, reason: str = "", request: Any = None) -> bool:
    """An operator removes their limit: the tool's own declaration (if any) applies again.
    Audited (``tool.limit_removed``). False when there was none."""
    actor.require("runs.operate_run")
    with transaction.atomic():
        row = ToolLimit.objects.select_for_update().filter(tool_name=tool_name).first()
        if row is None:
            return False
        before = _as_json(row)
        row.delete()
        _changed("tool.limit_removed", actor, request, tool_name, before, {"reason": reason})
    return True


def _changed(action: str, actor: Any, request: Any, tool_name: str, before: Any, after: Any):
    """In the change's transaction: its audit entry; after the commit, the waiters of the
    tool are looked at again under the new limit."""
    from runs.audit.entries import audit_record

    audit_record(
        action=action,
        actor=actor.label,
        channel=actor.channel,
        request=request,
        object_type="tool",
        object_id=tool_name,
        before=before,
        after=after,
    )
    transaction.on_commit(lambda: _limits_changed(tool_name))


def _limits_changed(tool_name: str) -> None:
    configcache.refresh()
    for key in (
        ToolWaiter.objects.filter(tool_name=tool_name)
        .values_list("limit_key", flat=True)
        .distinct()
        .order_by()
    ):
        wake(tool_name, key)


@dataclass(frozen=True)
class LimitView:
    """A tool's limit as the console and the API show it."""

    tool_name: str
    declared: Limits | None
    operator: ToolLimit | None
    in_flight: int
    waiting: int

    @property
    def effective(self) -> Limits | None:
        if self.operator is not None:
            return limits_of(self.operator)
        return self.declared


def limit_views() -> list[LimitView]:
    """Every tool that has a limit (declared or an operator's), with what it holds now."""
    from runs.registry import registry

    operators = {row.tool_name: row for row in ToolLimit.objects.all()}
    declared = {tool.name: tool.limits for tool in registry.tools() if tool.limits is not None}
    waiting = waiting_counts()
    return [
        LimitView(
            name,
            declared.get(name),
            operators.get(name),
            _holding_all_keys(name).count(),
            waiting.get(name, 0),
        )
        for name in sorted(set(operators) | set(declared))
    ]


def _holding_all_keys(tool_name: str):
    return ToolCall.objects.filter(
        tool_name=tool_name,
        status__in=(ToolCall.Status.DISPATCHING, ToolCall.Status.UNKNOWN),
        landing_deadline__gt=Now(),
    )


def in_flight_counts() -> dict[str, int]:
    """Calls holding a slot (dispatched, no receipt, before their landing deadline), by tool,
    for every tool (metrics)."""
    from django.db.models import Count

    return dict(
        ToolCall.objects.filter(
            status__in=(ToolCall.Status.DISPATCHING, ToolCall.Status.UNKNOWN),
            landing_deadline__gt=Now(),
        )
        .values_list("tool_name")
        .annotate(n=Count("id"))
        .order_by()
    )


# --- metrics (runs.metrics, docs/operations.md) -----------------------------------------------


def collect_metrics():
    """Per tool: calls holding a slot now (every tool: the downstream's load as the record
    sees it), runs waiting for capacity, the limit in force and the dispatches it granted."""
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    busy = GaugeMetricFamily(
        "agentops_tool_calls_in_flight",
        "Tool calls dispatched with no receipt yet whose landing deadline is ahead (a slot).",
        labels=["tool"],
    )
    for tool, n in sorted(in_flight_counts().items()):
        busy.add_metric([tool], n)
    waiting = GaugeMetricFamily(
        "agentops_tool_capacity_waiting",
        "Runs waiting for capacity on a limited tool.",
        labels=["tool"],
    )
    limit = GaugeMetricFamily(
        "agentops_tool_limit_max_in_flight",
        "The maximum of calls in flight a tool's limit allows (limited tools only).",
        labels=["tool"],
    )
    waits = waiting_counts()
    for view in limit_views():
        waiting.add_metric([view.tool_name], waits.get(view.tool_name, 0))
        effective = view.effective
        if effective is not None and effective.max_in_flight is not None:
            limit.add_metric([view.tool_name], effective.max_in_flight)
    granted = CounterMetricFamily(
        "agentops_tool_capacity_grants",
        "Dispatches of limited tools that took a slot, by tool.",
        labels=["tool"],
    )
    from django.db.models import Sum

    for tool, n in (
        ToolCapacity.objects.values_list("tool_name").annotate(n=Sum("grants")).order_by()
    ):
        granted.add_metric([tool], n or 0)
    yield from (busy, waiting, limit, granted)

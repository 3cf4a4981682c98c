"""Reads. Pages and the API get their data here, with no per-row queries."""

from __future__ import annotations

import base64
import json
import uuid
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from django.conf import settings
from django.contrib.auth import get_user_model
from django.core.cache import cache
from django.db import connection
from django.db.models import (
    BooleanField,
    Case,
    Count,
    Exists,
    ExpressionWrapper,
    F,
    OuterRef,
    Q,
    QuerySet,
    Value,
    When,
)
from django.db.models.functions import Now

from runs.models import (
    AgentManifest,
    Alert,
    Question,
    Run,
    RunEvent,
    Step,
    ToolCall,
    Worker,
)
from runs.record.eventtypes import EventType

# what the runs list shows; nothing else is loaded (state, input and result can be large)
_LIST_FIELDS = (
    "id",
    "agent_name",
    "agent_version",
    "goal",
    "status",
    "reason_code",
    "steps_used",
    "max_steps",
    "recovery_count",
    "dry_run",
    "created_at",
    "updated_at",
)


# Above this many runs (the planner's estimate), the ended runs' counts come from a cache
# refreshed every ENDED_COUNTS_SECONDS: counting a million ended runs costs ~100 ms a page
# (docs/benchmarks.md, "Scale"), and they change only by growing. The runs that may need
# someone (every status but the ended ones) are always counted exactly.
EXACT_COUNTS_UP_TO = 100_000
ENDED_COUNTS_SECONDS = 60


def run_status_counts(*, agent: str | None = None) -> dict[str, int]:
    """How many runs are in each status (every status present, zeros included), optionally
    of one agent only. The live statuses exactly, always; the ended ones exactly up to
    ``EXACT_COUNTS_UP_TO`` runs, then as counted at most ``ENDED_COUNTS_SECONDS`` ago."""
    counts = dict.fromkeys(Run.Status.values, 0)
    runs = Run.objects.filter(agent_name=agent) if agent else Run.objects.all()
    if _runs_estimate() <= EXACT_COUNTS_UP_TO:
        counts.update(_counts(runs))
        return counts
    # named, not "not ended": each status is then a range of the (status, created_at) index
    live = [status for status in Run.Status.values if status not in Run.TERMINAL]
    counts.update(_counts(runs.filter(status__in=live)))
    key = f"agentops:ended-run-counts:{agent or ''}"
    ended = cache.get(key)
    if ended is None:
        ended = _counts(runs.filter(status__in=Run.TERMINAL))
        cache.set(key, ended, ENDED_COUNTS_SECONDS)
    counts.update(ended)
    return counts


def _counts(runs: QuerySet[Run]) -> dict[str, int]:
    # COUNT(*): the (status, created_at) index alone answers it (an index-only scan)
    return dict(runs.order_by().values_list("status").annotate(n=Count("*")))


def _runs_estimate() -> int:
    """The planner's row estimate for the runs table (PostgreSQL; 0 elsewhere: exact)."""
    if connection.vendor != "postgresql":
        return 0
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT reltuples::bigint FROM pg_class WHERE oid = %s::regclass",
            [Run._meta.db_table],
        )
        row = cursor.fetchone()
    return int(row[0]) if row else 0


def run_get(*, run_id: Any) -> Run:
    """One run with its principal and the run it was promoted to, if any (a dry run's;
    Run.DoesNotExist if there is none)."""
    return Run.objects.select_related("principal", "promoted_to").get(id=run_id)


def runs_for_api(
    *, status: str | None = None, agent: str | None = None, dry_run: bool | None = None
) -> QuerySet[Run]:
    """Runs for a cursor-paginated list: list fields only, newest first."""
    runs = Run.objects.only(*_LIST_FIELDS)
    if status:
        runs = runs.filter(status=status)
    if agent:
        runs = runs.filter(agent_name=agent)
    if dry_run is not None:
        runs = runs.filter(dry_run=dry_run)
    return runs


def toolcalls_for_api(*, status: str | None = None, run: Any = None) -> QuerySet[ToolCall]:
    """Tool calls with their step and receipt (one query per page)."""
    calls = ToolCall.objects.select_related("step", "receipt")
    if status:
        calls = calls.filter(status=status)
    if run is not None:
        calls = calls.filter(run_id=run)
    return calls


# --- waits (docs/waits.md) ------------------------------------------------------------------------


def question_inbox(*, user: Any, recent: int = 20) -> tuple[list[Question], list[Question]]:
    """Open questions the user may answer (their groups; a superuser sees all), soonest to
    expire first, and the most recently settled ones: two queries."""
    questions = Question.objects.select_related("run", "answered_by").only(
        "id",
        "text",
        "choices",
        "group",
        "status",
        "asked_at",
        "expires_at",
        "answered_at",
        "channel",
        "run__id",
        "run__agent_name",
        "run__goal",
        "run__dry_run",
        "answered_by__username",
    )
    if not user.is_superuser:
        questions = questions.filter(group__in=user.groups.values("name"))
    open_ = list(questions.filter(status=Question.Status.OPEN).order_by("expires_at", "id"))
    settled = list(
        questions.exclude(status=Question.Status.OPEN).order_by("-asked_at", "-id")[:recent]
    )
    return open_, settled


def question_get(*, question_id: Any) -> Question:
    """One question with its run, step and who answered (Question.DoesNotExist if none)."""
    return Question.objects.select_related("run", "step", "answered_by").get(id=question_id)


def open_waits(*, run_id: Any) -> list[Step]:
    """The run's open wait steps (at most one) with their question, for the timeline and
    the API."""
    return list(
        Step.objects.filter(run_id=run_id, kind=Step.Kind.WAIT, status=Step.Status.PENDING)
        .select_related("question")
        .order_by("seq")
    )


# --- the console: run detail and unknown outcomes (docs/console.md) -------------------------------

TIMELINE_PAGE = 100  # events per timeline page: the latest ones, then "load older"
CALLS_SHOWN = 50  # the most recent tool calls on the run page
FORK_STEPS_SHOWN = 50  # finished steps offered as fork points


@dataclass
class RunDetail:
    run: Run
    events: list[RunEvent]  # ascending seq: the latest TIMELINE_PAGE events
    has_older: bool
    steps: dict[int, Step]  # seq -> step, for the steps those events name
    calls: list[ToolCall]  # newest first, with step and receipt
    calls_total: int
    approvals: dict[int, int]  # step seq -> id of the latest approval requested for it
    waits: list[Step]
    forks: list[Run]
    fork_steps: list[int]  # finished steps, newest first, a fork may start from


def run_events_page(
    *, run_id: Any, before: int | None = None, limit: int = TIMELINE_PAGE
) -> tuple[list[RunEvent], bool]:
    """The ``limit`` events before ``before`` (the latest when None), ascending, and whether
    older ones exist: one query on the (run, seq) unique index."""
    events = RunEvent.objects.filter(run_id=run_id).order_by("-seq")
    if before is not None:
        events = events.filter(seq__lt=before)
    page = list(events[: limit + 1])
    has_older = len(page) > limit
    return list(reversed(page[:limit])), has_older


def steps_by_seq(*, run_id: Any, seqs: list[int]) -> dict[int, Step]:
    """The named steps with their tool call and receipt: one query."""
    if not seqs:
        return {}
    steps = Step.objects.filter(run_id=run_id, seq__in=seqs).select_related(
        "tool_call", "tool_call__receipt"
    )
    return {step.seq: step for step in steps}


def run_with_lease(*, run_id: Any) -> Run:
    """One run with its principal and ``lease_is_live``, judged in database time like every
    lease decision (Run.DoesNotExist if there is none)."""
    live = ExpressionWrapper(Q(lease_expires_at__gt=Now()), output_field=BooleanField())
    return (
        Run.objects.select_related("principal", "promoted_to")
        .annotate(lease_is_live=live)
        .get(id=run_id)
    )


def run_detail(*, run_id: Any) -> RunDetail:
    """Everything the run page shows, in a number of queries that does not grow with the
    run's steps or events (Run.DoesNotExist if there is none)."""
    from runs import timeline

    run = run_with_lease(run_id=run_id)
    events, has_older = run_events_page(run_id=run.id)
    calls = list(
        ToolCall.objects.filter(run_id=run.id)
        .select_related("step", "receipt")
        .order_by("-step__seq")[:CALLS_SHOWN]
    )
    # always counted, so the page's query count does not depend on how many calls there are
    calls_total = ToolCall.objects.filter(run_id=run.id).count()
    # runs never imports approvals: the approval ids come from the run's own record
    requested = RunEvent.objects.filter(run_id=run.id, type=EventType.APPROVAL_REQUESTED).order_by(
        "-seq"
    )[:CALLS_SHOWN]
    approvals: dict[int, int] = {}
    for event in requested:
        approvals.setdefault(event.payload.get("seq"), event.payload.get("approval"))
    fork_steps = list(
        Step.objects.filter(run_id=run.id, status__in=[Step.Status.COMPLETED, Step.Status.FAILED])
        .exclude(kind__in=[Step.Kind.FINISH, Step.Kind.FAIL])
        .order_by("-seq")
        .values_list("seq", flat=True)[:FORK_STEPS_SHOWN]
    )
    return RunDetail(
        run=run,
        events=events,
        has_older=has_older,
        steps=steps_by_seq(run_id=run.id, seqs=timeline.step_seqs(events)),
        calls=calls,
        calls_total=calls_total,
        approvals=approvals,
        waits=open_waits(run_id=run.id),
        forks=list(
            Run.objects.filter(forked_from_id=run.id)
            .only("id", "status", "forked_from_step", "created_at")
            .order_by("created_at")
        ),
        fork_steps=fork_steps,
    )


def toolcall_latest_lookups(events: list[RunEvent]) -> dict[tuple[Any, Any], dict]:
    """(run id, step seq) -> the payload of the call's latest ``tool.reconcile_attempted``,
    from events already loaded (the unknown-outcomes pages load them anyway)."""
    latest: dict[tuple[Any, Any], tuple[int, dict]] = {}
    for event in events:
        if event.type != EventType.TOOL_RECONCILE_ATTEMPTED or not isinstance(event.payload, dict):
            continue
        key = (event.run_id, event.payload.get("seq"))
        if key not in latest or latest[key][0] < event.seq:
            latest[key] = (event.seq, event.payload)
    return {key: payload for key, (_, payload) in latest.items()}


_NOT_LOADED: Any = object()


def toolcall_absence_proven(*, call: ToolCall, latest_lookup: Any = _NOT_LOADED) -> bool:
    """Whether the record proves that the call's latest request never reached the system:
    its latest lookup answered ``absent`` and *started* after the landing deadline of its
    latest dispatch (DESIGN §9) — a lookup that began earlier may have looked before the
    request landed. Only then may a person mark it failed without attesting why: a call
    marked failed that had in fact succeeded lets the agent decide again under a new key.
    ``latest_lookup``: that lookup's event payload if already loaded
    (``toolcall_latest_lookups``; None when there was none), else one query."""
    deadline = call.landing_deadline
    if deadline is None:
        return False
    if (
        call.absent_lookup is not None
        and call.lookup_started_at is not None
        and call.lookup_started_at >= deadline
    ):
        return True  # a remote agent's absent, accepted by the server (runs.remote)
    if latest_lookup is _NOT_LOADED:
        latest_lookup = (
            RunEvent.objects.filter(
                run_id=call.run_id,
                type=EventType.TOOL_RECONCILE_ATTEMPTED,
                payload__seq=call.step.seq,
            )
            .order_by("-seq")
            .values_list("payload", flat=True)
            .first()
        )
    if not latest_lookup or latest_lookup.get("outcome") != "absent":
        return False
    try:
        started = datetime.fromisoformat(str(latest_lookup.get("started_at") or ""))
    except ValueError:
        return False
    return started.tzinfo is not None and started >= deadline


# the tool-call events that tell an unknown outcome's story in the inbox
OUTCOME_EVENT_TYPES = (
    EventType.TOOL_DISPATCHING,
    EventType.TOOL_UNKNOWN,
    EventType.TOOL_RECONCILE_ATTEMPTED,
    EventType.TOOL_RESOLVED,
)


UNKNOWN_SHOWN = 200  # an incident with more unknown outcomes than this is paged by age


def unknown_outcomes(*, limit: int = UNKNOWN_SHOWN) -> tuple[list[ToolCall], list[RunEvent], int]:
    """The calls whose outcome is unknown, oldest dispatch first (at most ``limit``), with
    their run and step; the dispatch / lookup / resolution events of their runs; and how
    many there are in all: three queries."""
    unknown = ToolCall.objects.filter(status=ToolCall.Status.UNKNOWN)
    calls = list(
        unknown.select_related("step", "run").order_by(
            F("dispatched_at").asc(nulls_first=True), "id"
        )[:limit]
    )
    total = len(calls) if len(calls) < limit else unknown.count()
    if not calls:
        return calls, [], 0
    events = list(
        RunEvent.objects.filter(
            run_id__in={call.run_id for call in calls}, type__in=OUTCOME_EVENT_TYPES
        ).order_by("run_id", "seq")
    )
    return calls, events, total


def unknown_for_triage(
    *,
    tool: str = "",
    since: datetime | None = None,
    until: datetime | None = None,
    limit: int = UNKNOWN_SHOWN,
) -> tuple[list[ToolCall], list[RunEvent]]:
    """The unknown outcomes waiting for a person (their run is in ``needs_attention``),
    by tool and by when they were sent, oldest first, with their lookup events: two
    queries."""
    calls = ToolCall.objects.filter(
        status=ToolCall.Status.UNKNOWN, run__status=Run.Status.NEEDS_ATTENTION
    )
    if tool:
        calls = calls.filter(tool_name=tool)
    if since is not None:
        calls = calls.filter(dispatched_at__gte=since)
    if until is not None:
        calls = calls.filter(dispatched_at__lt=until)
    calls = list(
        calls.select_related("step", "run").order_by(
            F("dispatched_at").asc(nulls_first=True), "id"
        )[:limit]
    )
    if not calls:
        return [], []
    events = list(
        RunEvent.objects.filter(
            run_id__in={call.run_id for call in calls}, type=EventType.TOOL_RECONCILE_ATTEMPTED
        ).only("id", "run_id", "seq", "type", "payload")
    )
    return calls, events


def unknown_outcome_get(*, tool_call_id: Any) -> tuple[ToolCall, list[RunEvent]]:
    """One call (any status) with its run, step and receipt, and its story's events."""
    call = ToolCall.objects.select_related("step", "run", "receipt").get(id=tool_call_id)
    events = list(
        RunEvent.objects.filter(
            run_id=call.run_id, type__in=OUTCOME_EVENT_TYPES, payload__seq=call.step.seq
        ).order_by("seq")
    )
    return call, events


# --- the operator console: dashboard and runs list (docs/operations.md, "Console and alerts") --


@dataclass(frozen=True)
class WorkerHealth:
    workers: list[Worker]  # each with ``.alive`` (a fresh heartbeat, not stopped)
    live: int
    frozen: list[Worker]
    stale: list[Worker]  # not stopped, but no heartbeat for WORKER_STALE_AFTER

    @property
    def alarm(self) -> str:
        """Why the dashboard shows a red banner ("" when all is well)."""
        if self.frozen:
            names = ", ".join(w.name for w in self.frozen)
            return f"The worker cluster looks frozen ({names}): runs are not advancing."
        if not self.live:
            return "No worker is running: no run will advance until one starts."
        return ""


def worker_health(*, limit: int = 50) -> WorkerHealth:
    """Every worker identity with whether its heartbeat is fresh, judged by database time
    (one query): a stale heartbeat means the process is gone, whatever ``health`` says."""
    stale_after = timedelta(seconds=settings.AGENTOPS["WORKER_STALE_AFTER"])
    workers = list(
        Worker.objects.annotate(
            alive=Case(
                When(
                    Q(heartbeat_at__gte=Now() - stale_after) & ~Q(health=Worker.Health.STOPPED),
                    then=Value(True),
                ),
                default=Value(False),
                output_field=BooleanField(),
            )
        ).order_by("-alive", "name")[:limit]
    )
    live = [w for w in workers if w.alive and w.health != Worker.Health.FROZEN]
    frozen = [w for w in workers if w.alive and w.health == Worker.Health.FROZEN]
    stale = [w for w in workers if not w.alive and w.health != Worker.Health.STOPPED]
    return WorkerHealth(workers=workers, live=len(live), frozen=frozen, stale=stale)


EVENT_PAGE_SIZE = 50


def event_search(
    *,
    type: str = "",
    actor: str = "",
    run: str = "",
    since: datetime | None = None,
    until: datetime | None = None,
    before: int | None = None,
    size: int | None = None,
) -> tuple[list[RunEvent], int | None]:
    """Events across all runs, newest first: by type (exact, or a prefix ending in "." such
    as ``approval.``), by actor (any part of it: ``user:dana``, ``worker:``, ``token:``), by
    run id prefix, by time; a page of ``size`` before the event id ``before``. Returns the
    page and the cursor of the next one (None on the last). Payloads are not loaded: the
    page names what happened and links to the run, whose page shows it (masked)."""
    events = _events_with_run_names()
    type = type.strip()
    if type.endswith("."):
        events = events.filter(type__startswith=type)
    elif type:
        events = events.filter(type=type)
    if actor.strip():
        events = events.filter(actor__icontains=actor.strip())
    id_range = _id_prefix_range(run.strip()) if run.strip() else None
    if run.strip() and id_range is None:
        return [], None  # not a run id: nothing matches, rather than everything
    if id_range is not None:
        events = events.filter(run_id__gte=id_range[0], run_id__lte=id_range[1])
    if since is not None:
        events = events.filter(created_at__gte=since)
    if until is not None:
        events = events.filter(created_at__lt=until)
    if before is not None:
        events = events.filter(id__lt=before)
    size = size or EVENT_PAGE_SIZE
    rows = list(events.order_by("-id")[: size + 1])
    more = len(rows) > size
    rows = rows[:size]
    return rows, (rows[-1].id if more and rows else None)


def recent_events(*, limit: int = 20) -> list[RunEvent]:
    """The latest events across all runs (the ``-created_at`` index), with the run's name."""
    return list(_events_with_run_names().order_by("-created_at", "-id")[:limit])


def _events_with_run_names() -> QuerySet[RunEvent]:
    """Events without payloads, with what names their run to people (agent, goal, id)."""
    return RunEvent.objects.select_related("run").only(
        "id",
        "seq",
        "type",
        "actor",
        "channel",
        "created_at",
        "run__id",
        "run__agent_name",
        "run__goal",
        "run__dry_run",
    )


# The runs list pages by keyset (a cursor on the sort key + id), never by OFFSET and never
# with COUNT(*): page 2,000 of 100,000 runs costs what page 1 costs.
RUN_SORTS: dict[str, tuple[tuple[str, bool], ...]] = {
    # key: ((field, descending), ...) — id is always the last tie-breaker
    "-created": (("created_at", True),),
    "created": (("created_at", False),),
    "-updated": (("updated_at", True),),
    "updated": (("updated_at", False),),
    # alphabetical so the (status, -created_at) index serves it
    "status": (("status", False), ("created_at", True)),
}
RUN_PAGE_SIZE = 50


@dataclass(frozen=True)
class RunPage:
    runs: list[Run]
    next_cursor: str  # "" on the last page
    prev_cursor: str  # "" on the first page


def _cursor_encode(run: Run, order: tuple[tuple[str, bool], ...]) -> str:
    values = [
        getattr(run, field).isoformat() if field.endswith("_at") else getattr(run, field)
        for field, _ in order
    ]
    raw = json.dumps([*values, run.id.hex]).encode()
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def _cursor_decode(cursor: str, order: tuple[tuple[str, bool], ...]) -> list[Any] | None:
    """The cursor's values, or None for a cursor that is not ours (a stale bookmark or a
    hand-edited URL shows the first page instead of an error)."""
    try:
        raw = base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4))
        values = json.loads(raw)
        if not isinstance(values, list) or len(values) != len(order) + 1:
            return None
        decoded: list[Any] = []
        for (field, _), value in zip(order, values[:-1], strict=True):
            if field.endswith("_at"):
                moment = datetime.fromisoformat(value)
                if moment.tzinfo is None:
                    return None
                decoded.append(moment)
            elif isinstance(value, str):
                decoded.append(value)
            else:
                return None
        decoded.append(uuid.UUID(hex=values[-1]))
        return decoded
    except (ValueError, TypeError, json.JSONDecodeError):
        return None


def _keyset(order: tuple[tuple[str, bool], ...], values: list[Any], *, forward: bool) -> Q:
    """Rows strictly after (forward) or before the cursor in the sort order."""
    columns = [*order, ("id", True)]
    condition = Q()
    for i, (field, descending) in enumerate(columns):
        after_is_less = descending == forward
        lookup = "lt" if after_is_less else "gt"
        equal = {name: values[j] for j, (name, _) in enumerate(columns[:i])}
        condition |= Q(**equal, **{f"{field}__{lookup}": values[i]})
    return condition


def _id_prefix_range(text: str) -> tuple[uuid.UUID, uuid.UUID] | None:
    """A run id prefix ("3fa85f64" or "3fa85f64-5717") as an id range the primary key index
    answers, instead of a LIKE over every id cast to text."""
    digits = text.lower().replace("-", "")
    if not 4 <= len(digits) <= 32 or any(c not in "0123456789abcdef" for c in digits):
        return None
    return (
        uuid.UUID(hex=digits.ljust(32, "0")),
        uuid.UUID(hex=digits.ljust(32, "f")),
    )


def _searchable_input(text: str) -> Q:
    """Runs whose input has ``text`` as the value of a field their agent declares
    searchable (``Agent.searchable_input``: an order id, a customer)."""
    from runs.registry import registry

    found = Q(pk__in=[])
    for agent in registry.agents():
        for field in agent.searchable_input:
            # on PostgreSQL as containment (``@>``): the input's GIN index answers it
            # (run_input_path_idx); SQLite has no JSON containment
            match = (
                {"input__contains": {field: text}}
                if connection.vendor == "postgresql"
                else {f"input__{field}": text}
            )
            found |= Q(agent_name=agent.name, **match)
    return found


def run_search(
    *,
    status: str = "",
    agent: str = "",
    text: str = "",
    reason: str = "",
    tool: str = "",
    principal: str = "",
    key: str = "",
    since: datetime | None = None,
    until: datetime | None = None,
) -> QuerySet[Run]:
    """Runs matching the list's filters: status, reason, agent, a tool it called, its
    principal, a call's idempotency key, when it was created, and text — in the goal, an id
    prefix, or a searchable input field's value."""
    runs = Run.objects.select_related("principal").only(
        *_LIST_FIELDS, "lease_owner", "principal__username"
    )
    if status:
        runs = runs.filter(status=status)
    if reason:
        runs = runs.filter(reason_code=reason)
    if agent:
        runs = runs.filter(agent_name=agent)
    if principal:
        # the principal's id first: filtered by it, the runs' principal index answers (by
        # name, the planner walks every run looking for the name)
        principal_id = (
            get_user_model().objects.filter(username=principal).values_list("id", flat=True).first()
        )
        runs = runs.filter(principal_id=principal_id) if principal_id else runs.none()
    if since is not None:
        runs = runs.filter(created_at__gte=since)
    if until is not None:
        runs = runs.filter(created_at__lt=until)
    if tool:
        runs = runs.filter(Exists(ToolCall.objects.filter(run=OuterRef("pk"), tool_name=tool)))
    if key:
        # a key is the family's (``<root run>:<seq>``): every run of the family that made
        # the call, a fork included
        runs = runs.filter(
            Exists(ToolCall.objects.filter(run=OuterRef("pk"), idempotency_key=key.strip()))
        )
    text = text.strip()
    if text:
        id_range = _id_prefix_range(text)
        if id_range is not None and len(text.replace("-", "")) >= 8:
            # a pasted id (or its first 8 characters, as pages show it): the primary key
            # index alone answers, instead of scanning every goal
            runs = runs.filter(id__gte=id_range[0], id__lte=id_range[1])
        elif id_range is not None:
            runs = runs.filter(
                Q(goal__icontains=text)
                | Q(id__gte=id_range[0], id__lte=id_range[1])
                | _searchable_input(text)
            )
        else:
            runs = runs.filter(Q(goal__icontains=text) | _searchable_input(text))
    return runs


def run_page(
    runs: QuerySet[Run],
    *,
    sort: str = "-created",
    after: str = "",
    before: str = "",
    size: int | None = None,
) -> RunPage:
    """One page of ``runs`` in ``sort`` order, after or before a cursor (one query)."""
    size = size or RUN_PAGE_SIZE
    order = RUN_SORTS.get(sort, RUN_SORTS["-created"])
    forward = not before
    values = _cursor_decode(after or before, order) if (after or before) else None
    ordering = [f"-{f}" if desc == forward else f for f, desc in [*order, ("id", True)]]
    page = runs.order_by(*ordering)
    if values is not None:
        page = page.filter(_keyset(order, values, forward=forward))
    rows = list(page[: size + 1])
    more = len(rows) > size
    rows = rows[:size]
    if not forward:
        rows.reverse()
    if values is None:
        # the first page: nothing before it
        return RunPage(rows, _cursor_encode(rows[-1], order) if more else "", "")
    if forward:
        return RunPage(
            rows,
            _cursor_encode(rows[-1], order) if more else "",
            _cursor_encode(rows[0], order) if rows else "",
        )
    return RunPage(
        rows,
        _cursor_encode(rows[-1], order) if rows else "",
        _cursor_encode(rows[0], order) if more else "",
    )


def run_agent_names() -> list[str]:
    """Agents to filter by and to start: registered in code and registered remotely."""
    from runs.registry import registry

    names = {agent.name for agent in registry.agents()}
    names.update(AgentManifest.objects.values_list("name", flat=True))
    return sorted(names)


def undelivered_messages(*, limit: int = 10) -> dict[str, Any]:
    """Emails and webhook deliveries given up on (runs.outbox), newest first, and how many
    are being retried after a failed attempt (counted up to ``RETRY_COUNT_CAP`` each): the
    people they were meant for have not been told. One query per channel."""
    from runs.models import OutboxMessage, WebhookDelivery

    troubled = Q(status="failed") | Q(status="pending", attempts__gt=0)
    emails = list(
        OutboxMessage.objects.filter(troubled)
        .only(
            "id", "kind", "to_address", "run_id", "status", "attempts", "last_error", "created_at"
        )
        .order_by("-created_at")[:RETRY_COUNT_CAP]
    )
    webhooks = list(
        WebhookDelivery.objects.filter(troubled)
        .only("id", "event_type", "run_id", "status", "attempts", "last_error", "created_at")
        .order_by("-created_at")[:RETRY_COUNT_CAP]
    )
    return {
        "emails": [m for m in emails if m.status == "failed"][:limit],
        "webhooks": [d for d in webhooks if d.status == "failed"][:limit],
        "retrying": sum(1 for row in emails + webhooks if row.status == "pending"),
    }


RETRY_COUNT_CAP = 100


def recent_alerts(*, limit: int = 10) -> list[Alert]:
    """Operator alerts of the last day, newest first: whether each was emailed and whether
    its cause went away (runs.alerts)."""
    return list(
        Alert.objects.filter(created_at__gte=Now() - timedelta(days=1))
        .select_related("run")
        .only(
            "id",
            "cause",
            "kind",
            "run__id",
            "run__agent_name",
            "run__goal",
            "run__dry_run",
            "worker_name",
            "detail",
            "created_at",
            "notified_at",
            "resolved_at",
        )
        .order_by("-created_at", "-id")[:limit]
    )

"""``make bench``'s ``scale`` section (issue 24, docs/benchmarks.md): the record as a year of
a busy deployment leaves it — by default 1,000,000 finished runs and 10,000,000 events,
hash chains included — and what each read the product makes costs there: the sweeper's
tick, the claim, the dashboard, the runs list with each filter, a run page of 10,000
events, one run's ``audit_verify``, an incremental ``audit_verify`` of the whole record
and a ``prune`` batch. Each with its p95, its query count
and its plans: a sequential scan of a table that grows with history is reported (and fails
the target).

The fill is SQL (``INSERT … SELECT``), one step of the chain at a time: every run's event
``seq`` is hashed for all runs in one statement, with the same fields and format as
``runs.record.chain`` (``audit_verify`` accepts them; the suite checks it).
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

from django.db import connection, transaction

from agentops.bench import agents
from agentops.bench.measure import SYSTEM, create_runs, no_wakeups, pct, rounded
from runs import engine
from runs.audit import partitions
from runs.models import Run, RunEvent
from runs.record.chain import payload_digest
from runs.record.eventtypes import EventType

# tables that grow with history: a sequential scan of one of them is a finding
GROWING = ("runs_run", "runs_runevent", "runs_step", "runs_toolcall", "runs_toolreceipt")
# below this many rows a sequential scan is the right plan, not a finding
SMALL_TABLE_ROWS = 10_000
TARGETS = {"page_ms_p95": 150.0, "sweeper_ms_p95": 50.0, "claim_ratio": 1.10}

# the event types of a finished run's record, by seq (first, middle cycle, last)
_FIRST = EventType.RUN_CREATED
_CYCLE = (EventType.STEP_DECIDED, EventType.TOOL_DISPATCHING, EventType.TOOL_SUCCEEDED)
_LAST = EventType.RUN_SUCCEEDED
# Python's isoformat() of an aware UTC time with microseconds (every fill time has some)
_ISO = "to_char({} AT TIME ZONE 'UTC', 'YYYY-MM-DD\"T\"HH24:MI:SS.US') || '+00:00'"


def _sha(expression: str) -> str:
    return f"encode(sha256(convert_to({expression}, 'UTF8')), 'hex')"


def fill(runs: int, events: int, template_id: uuid.UUID, say: Callable[[str], None]) -> dict:
    """``runs`` finished runs of ``events // runs`` events each, created over the past
    year, chained; returns the time each part took."""
    per_run = max(2, events // max(1, runs))
    digest = payload_digest({})
    timings: dict[str, float] = {}
    spacing = 365 * 24 * 3600 / max(1, runs)
    with connection.cursor() as cursor:
        began = time.perf_counter()
        cursor.execute("DROP TABLE IF EXISTS scale_events")
        cursor.execute(
            "CREATE UNLOGGED TABLE scale_events (run_id uuid, seq int, created_at timestamptz,"
            " type text, actor text, channel text, incarnation bigint, prev_hash text,"
            " hash text)"
        )
        # a run's events are a millisecond apart, its first at a time with microseconds
        # (isoformat() leaves out a zero fraction: the fill never has one)
        first = (
            "SELECT id, 1, t0, %s::text, 'system', 'api', NULL::bigint, anchor, "
            + _sha(
                "concat_ws('|', anchor, id::text, '1', "
                + _ISO.format("t0")
                + ", %s::text, 'system', 'api', '', %s::text)"
            )
            + " FROM (SELECT gen_random_uuid() AS id, date_trunc('second', now())"
            " - make_interval(secs => n * %s::float8) + interval '7 microseconds' AS t0"
            " FROM generate_series(1, %s::int) n) g, LATERAL (SELECT "
            + _sha("'agentops-run:' || g.id::text")
            + " AS anchor) a"
        )
        cursor.execute(f"INSERT INTO scale_events {first}", [_FIRST, _FIRST, digest, spacing, runs])
        cursor.execute("CREATE INDEX ON scale_events (seq)")
        for seq in range(2, per_run + 1):
            kind = _LAST if seq == per_run else _CYCLE[(seq - 2) % len(_CYCLE)]
            at = f"(p.created_at + interval '{seq - 1} milliseconds')"
            cursor.execute(
                "INSERT INTO scale_events SELECT p.run_id, %s::int, "
                + at
                + ", %s::text, 'worker:scale', 'worker', 1, p.hash, "
                + _sha(
                    "concat_ws('|', p.hash, p.run_id::text, %s::text, "
                    + _ISO.format(at)
                    + ", %s::text, 'worker:scale', 'worker', '1', %s::text)"
                )
                + " FROM scale_events p WHERE p.seq = %s::int",
                [seq, kind, str(seq), kind, digest, seq - 1],
            )
            if seq % 5 == 0:
                say(f"scale: chained {seq} of {per_run} events per run")
        timings["chain_s"] = time.perf_counter() - began

        began = time.perf_counter()
        _insert_runs(cursor, template_id, per_run)
        timings["runs_s"] = time.perf_counter() - began
        say(f"scale: {runs} runs written; now {runs * per_run} events")

        began = time.perf_counter()
        # a partition per month of the year filled, as `retention --create-ahead` keeps them
        # (runs 0031): not a year of events in the DEFAULT partition
        _month_partitions(cursor)
        # a run's events are a millisecond apart from its creation (the first event's time)
        cursor.execute(
            "INSERT INTO runs_runevent (run_id, seq, created_at, type, actor, channel,"
            " incarnation, payload, trace_id, span_id, payload_digest, prev_hash, hash,"
            " run_created_at)"
            " SELECT run_id, seq, created_at, type, actor, channel, incarnation, '{}'::jsonb,"
            " '', '', %s::text, prev_hash, hash,"
            " created_at - (seq - 1) * interval '1 millisecond'"
            " FROM scale_events ORDER BY run_id, seq",
            [digest],
        )
        timings["events_s"] = time.perf_counter() - began
        cursor.execute("DROP TABLE scale_events")
        began = time.perf_counter()
        # what autovacuum does to a table that grew over time (outside a transaction)
        cursor.execute("ANALYZE" if connection.in_atomic_block else "VACUUM (ANALYZE)")
        timings["analyze_s"] = time.perf_counter() - began
    return {name: round(value, 1) for name, value in timings.items()} | {"events_per_run": per_run}


def _month_partitions(cursor: Any) -> None:
    """The events' partitions of every month the filled runs were created in."""
    if not partitions.partitioned():
        return
    cursor.execute(
        "SELECT DISTINCT date_trunc('month', created_at AT TIME ZONE 'UTC')::date"
        " FROM scale_events WHERE seq = 1 ORDER BY 1"
    )
    months = [month for (month,) in cursor.fetchall()]
    with transaction.atomic():
        for month in months:
            partitions.ensure_partition(month)


def _insert_runs(cursor: Any, template_id: uuid.UUID, per_run: int) -> None:
    """One run row per chain, copied from a finished template run: almost all ended (a
    year of history), one in a thousand still waiting for a person."""
    fields = list(Run._meta.concrete_fields)
    columns = ", ".join(connection.ops.quote_name(f.column) for f in fields)
    overrides = {
        "id": "e.run_id",
        "root_run_id": "e.run_id",
        "trace_id": "md5(e.run_id::text)",
        "status": "CASE WHEN mod(abs(hashtext(e.run_id::text)), 1000) = 0 THEN"
        " 'needs_attention' WHEN mod(abs(hashtext(e.run_id::text)), 10) = 0 THEN 'failed'"
        " ELSE 'succeeded' END",
        "created_at": "e.t0",
        "updated_at": "e.t0 + interval '1 second'",
        "finished_at": "e.t0 + interval '1 second'",
        "event_seq": str(per_run),
        "last_event_hash": "e.last_hash",
        "lease_owner": "''",
        "lease_expires_at": "NULL",
        "wake_at": "NULL",
        "enqueued_at": "NULL",
    }
    select = ", ".join(
        overrides.get(f.column, f"t.{connection.ops.quote_name(f.column)}") for f in fields
    )
    cursor.execute(
        f"INSERT INTO runs_run ({columns}) SELECT {select} FROM runs_run t, (SELECT"
        " f.run_id, f.created_at AS t0, l.hash AS last_hash FROM scale_events f JOIN"
        " scale_events l ON l.run_id = f.run_id AND l.seq = %s::int WHERE f.seq = 1) e"
        " WHERE t.id = %s::uuid",
        [per_run, str(template_id)],
    )


# --- what each read costs -----------------------------------------------------------------


class Plans:
    """Every query a measured call makes, kept to be EXPLAINed afterwards."""

    def __init__(self) -> None:
        self.statements: list[tuple[str, Any]] = []

    def __call__(self, execute, sql, params, many, context):
        if not many:
            self.statements.append((sql, params))
        return execute(sql, params, many, context)

    @contextmanager
    def installed(self) -> Iterator[Plans]:
        with connection.execute_wrapper(self):
            yield self

    def sequential_scans(self) -> list[str]:
        """The growing tables a plan reads whole (reads only: a write's plan is not run)."""
        found = set()
        for sql, params in self.statements:
            verb = sql.lstrip().split(None, 1)[0].upper()
            if verb not in ("SELECT", "WITH"):
                continue
            if verb == "WITH" and any(w in sql for w in ("INSERT INTO", "UPDATE ", "DELETE ")):
                continue
            with connection.cursor() as cursor:
                cursor.execute("EXPLAIN (FORMAT JSON) " + sql, params)
                (plan,) = cursor.fetchone()
            if isinstance(plan, str):
                plan = json.loads(plan)
            for node in _nodes(plan[0]["Plan"]):
                table = node.get("Relation Name") or ""
                # a partition of the events (runs 0031) counts by its own rows: an empty
                # month's is read whole and costs nothing
                growing = table in GROWING or table.startswith("runs_runevent_")
                if node.get("Node Type") == "Seq Scan" and growing:
                    found.add(table)
        return sorted(table for table in found if _estimate(table) >= SMALL_TABLE_ROWS)


def _nodes(node: dict) -> Iterator[dict]:
    yield node
    for child in node.get("Plans", []):
        yield from _nodes(child)


def timed(call: Callable[[], Any], repeat: int) -> dict:
    """p50/p95 of ``call`` (after one warm call), its query count and the growing tables its
    plans scan whole."""
    call()
    plans = Plans()
    with plans.installed():
        call()
    times = []
    for _ in range(repeat):
        began = time.perf_counter()
        call()
        times.append((time.perf_counter() - began) * 1000)
    return {
        "queries": len(plans.statements),
        "ms_p50": rounded(pct(times, 50), 2),
        "ms_p95": rounded(pct(times, 95), 2),
        "seq_scans": plans.sequential_scans(),
    }


def _claims(count: int) -> dict:
    """Claims of fresh queued runs (each claimed once, then released): p50/p95."""
    with no_wakeups():
        ids = create_runs(agents.READ_AGENT, count + 5, 1)
    times = []
    for index, run_id in enumerate(ids):
        began = time.perf_counter()
        lease = engine.claim(run_id, worker="bench-scale")
        if index >= 5:  # the first ones warm the caches
            times.append((time.perf_counter() - began) * 1000)
        if lease is not None:
            engine.release(lease)
    return {"ms_p50": rounded(pct(times, 50), 3), "ms_p95": rounded(pct(times, 95), 3)}


def _big_run(events: int) -> uuid.UUID:
    """A run driven by the engine until its record holds ``events`` events."""
    with no_wakeups():
        (run_id,) = create_runs(agents.READ_AGENT, 1, events)
        while RunEvent.objects.filter(run_id=run_id).count() < events:
            if engine.advance(run_id, worker="bench-scale") == "not_claimed":
                break
    return run_id


def scale(
    say: Callable[[str], None], *, runs: int, events: int, big_events: int, repeat: int
) -> dict:
    from django.contrib.auth import get_user_model
    from django.core.management import call_command
    from django.test import Client
    from django.test.utils import override_settings
    from django.urls import reverse

    from runs import sweeper
    from runs.audit.retention import prune_candidates, run_prune

    say(f"scale: a run of {big_events} events, the claim on a small table")
    big_run = _big_run(big_events)
    claim_small = _claims(30)
    results: dict[str, Any] = {}
    say(f"scale: filling {runs} runs / {events} events")
    began = time.perf_counter()
    results["fill"] = fill(runs, events, big_run, say)
    results["fill"]["total_s"] = round(time.perf_counter() - began, 1)
    results["runs_in_table"] = Run.objects.count()
    results["events_in_table"] = _estimate("runs_runevent")
    claim_big = _claims(30)
    results["claim"] = {
        "small_table": claim_small,
        "large_table": claim_big,
        "ratio_p50": rounded(claim_big["ms_p50"] / claim_small["ms_p50"], 3)
        if claim_small["ms_p50"]
        else None,
    }
    results["sweeper"] = timed(sweeper.sweep, repeat)

    user = get_user_model().objects.create_superuser(
        username=f"bench-scale-{uuid.uuid4().hex[:6]}", password=None
    )
    some = Run.objects.filter(status=Run.Status.FAILED).values("agent_name").first() or {}
    since = Run.objects.order_by("-created_at").values_list("created_at", flat=True).first()
    pages: dict[str, Any] = {}
    with override_settings(ALLOWED_HOSTS=["testserver"]):
        client = Client(raise_request_exception=False)
        client.force_login(user)
        runs_list = reverse("runs:list")
        urls = {
            "dashboard": reverse("runs:dashboard"),
            "runs list": runs_list,
            "runs list ?status=failed": f"{runs_list}?status=failed",
            "runs list ?status=needs_attention": f"{runs_list}?status=needs_attention",
            "runs list ?reason=unknown_outcome": f"{runs_list}?reason=unknown_outcome",
            "runs list ?agent=": f"{runs_list}?agent={some.get('agent_name', '')}",
            "runs list ?tool=": f"{runs_list}?tool=bench_read",
            "runs list ?principal=": f"{runs_list}?principal=nobody",
            "runs list ?key=": f"{runs_list}?key=k-1",
            "runs list ?since=": f"{runs_list}?since="
            + ((since - timedelta(days=1)).strftime("%Y-%m-%dT%H:%M") if since else ""),
            "runs list ?q=": f"{runs_list}?q=refund",
            "runs list, oldest first": f"{runs_list}?sort=created",
            f"run page ({big_events} events)": reverse("runs:detail", kwargs={"run_id": big_run}),
            "GET /api/v1/runs/": reverse("api:runs"),
        }
        for label, url in urls.items():

            def get(url: str = url) -> None:
                response = client.get(url, secure=True)
                if response.status_code != 200:
                    raise RuntimeError(f"{url}: HTTP {response.status_code}")

            try:
                pages[label] = {"url": url, **timed(get, repeat)}
            except RuntimeError as exc:
                pages[label] = {"url": url, "error": str(exc)}
    results["pages"] = pages

    say("scale: audit_verify of the big run, incremental audit_verify, a prune batch")
    began = time.perf_counter()
    call_command("audit_verify", run=str(big_run), stdout=_Null(), stderr=_Null())
    results["audit_verify_one_run_s"] = round(time.perf_counter() - began, 3)
    # incremental audit_verify of the whole record, as a daily check finds it: every run
    # verified before (as if a --full check had run; marked here by SQL, not measured), a
    # few with new events since (the claim's runs). What it costs is the runs that changed
    # plus one pass over the runs and their verified heads, whatever the number of events
    with connection.cursor() as cursor:
        cursor.execute(
            "INSERT INTO runs_verifiedchain (run_id, seq, hash, verified_at)"
            " SELECT id, event_seq, last_event_hash, now() FROM runs_run"
            " WHERE event_seq > 0 AND status IN ('succeeded', 'failed')"
            " ON CONFLICT (run_id) DO NOTHING"
        )
    began = time.perf_counter()
    call_command("audit_verify", stdout=_Null(), stderr=_Null())
    results["audit_verify_incremental_s"] = round(time.perf_counter() - began, 3)
    actor = SYSTEM
    began = time.perf_counter()
    batch = list(prune_candidates(timedelta(days=30)).values_list("id", flat=True)[:100])
    found_in = time.perf_counter() - began
    began = time.perf_counter()
    for run_id in batch:
        run_prune(run_id=run_id, actor=actor, older_than="30d")
    results["prune"] = {
        "batch": len(batch),
        "candidates_ms": round(found_in * 1000, 1),
        "per_run_ms": round((time.perf_counter() - began) * 1000 / max(1, len(batch)), 2),
    }
    results["targets"] = scale_targets(results)
    return results


def scale_targets(results: dict) -> dict:
    pages = results.get("pages", {})
    worst = max(
        (figures.get("ms_p95") or 0 for figures in pages.values() if "error" not in figures),
        default=None,
    )
    scans = sorted(
        {
            f"{label}: {table}"
            for label, figures in {**pages, "sweeper": results.get("sweeper", {})}.items()
            for table in figures.get("seq_scans", [])
        }
    )
    ratio = results.get("claim", {}).get("ratio_p50")
    sweeper_p95 = results.get("sweeper", {}).get("ms_p95")
    return {
        "pages_p95_max_ms": worst,
        "pages_ok": worst is not None
        and worst <= TARGETS["page_ms_p95"]
        and not any("error" in f for f in pages.values()),
        "sweeper_ok": sweeper_p95 is not None and sweeper_p95 <= TARGETS["sweeper_ms_p95"],
        "claim_ok": ratio is not None and ratio <= TARGETS["claim_ratio"],
        "sequential_scans": scans,
        "plans_ok": not scans,
    }


def _estimate(table: str) -> int:
    # a partitioned table (the events, runs 0031) holds no rows itself: its partitions do
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT CASE WHEN c.relkind = 'p' THEN (SELECT sum(greatest(l.reltuples, 0))::bigint"
            " FROM pg_partition_tree(c.oid) t JOIN pg_class l ON l.oid = t.relid WHERE t.isleaf)"
            " ELSE c.reltuples::bigint END FROM pg_class c WHERE c.relname = %s",
            [table],
        )
        row = cursor.fetchone()
    return int(row[0]) if row and row[0] is not None else 0


class _Null:
    def write(self, *args: Any, **kwargs: Any) -> None:
        pass

    def flush(self) -> None:
        pass

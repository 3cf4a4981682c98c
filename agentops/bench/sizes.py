"""What the record costs on disk, per run and per step (docs/operations.md, "Retention").

Drives ``runs`` runs of the bench's idempotent agent (``steps`` steps each: a decision, a tool
call, its receipt) to the end through the engine, on PostgreSQL, and reads
``pg_total_relation_size`` (heap, TOAST, every index) of each table that grows with history
before and after; then times ``audit_verify --full`` over those events. Run it on an empty,
migrated database of its own::

    DATABASE_URL=postgres://…/agentops_sizes python manage.py migrate
    LOG_LEVEL=WARNING DATABASE_URL=postgres://…/agentops_sizes python manage.py shell -c \\
        "from agentops.bench.sizes import main; main()"
"""

from __future__ import annotations

import io
import json
import time
from typing import Any

from django.core.management import call_command
from django.db import connection

from agentops.bench import agents
from agentops.bench.measure import create_runs, no_wakeups
from runs import engine
from runs.models import RunEvent

TABLES = ("runs_run", "runs_runevent", "runs_step", "runs_toolcall", "runs_toolreceipt")


def table_sizes() -> dict[str, int]:
    with connection.cursor() as cursor:
        # a partitioned table (the events, runs 0031) is the sum of its partitions
        cursor.execute(
            "SELECT c.relname, CASE WHEN c.relkind = 'p' THEN (SELECT "
            "sum(pg_total_relation_size(t.relid))::bigint FROM pg_partition_tree(c.oid) t) "
            "ELSE pg_total_relation_size(c.oid) END FROM pg_class c "
            "WHERE c.relname = ANY(%s) AND c.relkind IN ('r', 'p')",
            [list(TABLES)],
        )
        return dict(cursor.fetchall())


def measure(runs: int = 1000, steps: int = 10) -> dict[str, Any]:
    if connection.vendor != "postgresql":
        raise SystemExit("sizes are measured on PostgreSQL")
    agents.register()
    before = table_sizes()
    events_before = RunEvent.objects.count()
    began = time.perf_counter()
    with no_wakeups():
        run_ids = create_runs(agents.IDEMPOTENT_AGENT, runs, steps)
        for run_id in run_ids:
            while engine.advance(run_id, worker="sizes") != "not_claimed":
                pass
    driven_s = time.perf_counter() - began
    with connection.cursor() as cursor:
        # what autovacuum would have done by the time anyone looks (dead run-row versions)
        cursor.execute("VACUUM ANALYZE")
    after = table_sizes()
    events = RunEvent.objects.count() - events_before
    began = time.perf_counter()
    call_command("audit_verify", full=True, stdout=io.StringIO())
    verify_s = time.perf_counter() - began
    grown = {table: after[table] - before.get(table, 0) for table in TABLES}
    total = sum(grown.values())
    return {
        "runs": runs,
        "steps_per_run": steps,
        "events": events,
        "events_per_run": round(events / runs, 1),
        "driven_s": round(driven_s, 1),
        "bytes": grown,
        "bytes_total": total,
        "bytes_per_run": round(total / runs),
        "bytes_per_step": round(total / (runs * steps)),
        "bytes_per_event_in_events_table": round(grown["runs_runevent"] / events),
        "audit_verify_full_s": round(verify_s, 2),
        "audit_verify_events_per_s": round(RunEvent.objects.count() / verify_s if verify_s else 0),
    }


def main(runs: int = 1000, steps: int = 10) -> None:
    print(json.dumps(measure(runs, steps), indent=2))

"""The measurements of ``manage.py bench`` (docs/benchmarks.md says what each one means).

Every figure is measured next to its limit in the same run: the steps/s of the engine next
to a one-row INSERT + COMMIT loop on the same database at the same concurrency, the commits
per step next to the boundaries the design requires, a recovery next to the lease TTL.
"""

from __future__ import annotations

import os
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from unittest import mock

import psycopg
from django.db import connection
from django.db.models import Max, Min

from agentops.bench import agents
from agentops.bench.database import conninfo, xact_commits
from agentops.bench.procs import (
    BenchWorker,
    WorkerFailed,
    cpu_seconds,
    rss_bytes,
)
from runs import engine, queue, services
from runs.actors import Actor
from runs.models import Run, RunEvent
from runs.record.eventtypes import EventType

SYSTEM = Actor.system("cli")
__all__ = ["Context", "WorkerFailed"]


def pct(values: list[float], q: float) -> float | None:
    """Nearest-rank percentile; None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(q / 100 * len(ordered) + 0.5) - 1))
    return ordered[index]


def rounded(value: float | None, digits: int = 2) -> float | None:
    return None if value is None else round(value, digits)


@dataclass
class Context:
    """What every measurement needs: where the workers log, how to start them."""

    log_dir: Path
    worker_env: Callable[..., dict[str, str]]
    settings_dict: dict[str, Any]
    say: Callable[[str], None]
    # django-q2 task processes per worker in the throughput runs; None: as many in all as
    # the machine has cores (more only adds contention: the engine is CPU-bound)
    task_processes: int | None = None

    def processes_per_worker(self, workers: int) -> int:
        return self.task_processes or max(1, -(-(os.cpu_count() or 1) // workers))

    def start_workers(self, prefix: str, count: int, **env: str) -> list[BenchWorker]:
        workers = [
            BenchWorker(f"{prefix}-{i + 1}", self.worker_env(**env), self.log_dir)
            for i in range(count)
        ]
        try:
            for worker in workers:
                worker.wait_running()
        except Exception:
            for worker in workers:
                worker.kill()
            raise
        return workers


def create_runs(agent: str, count: int, steps: int, **extra: Any) -> list[uuid.UUID]:
    """Through the service, as a user's API call would: each run enqueues its wake-up."""
    return [
        services.run_create(
            agent_name=agent,
            goal=f"bench {agent}",
            input={"steps": steps, **extra},
            actor=SYSTEM,
            max_steps=steps + 1,
        ).id
        for _ in range(count)
    ]


@contextmanager
def no_wakeups() -> Iterator[None]:
    """For runs this process drives itself: no django-q2 task is left behind for workers."""
    with mock.patch.object(queue, "enqueue_run", lambda run_id: None):
        yield


class Poller:
    """Polls the bench database on its own connection, counting its own transactions so
    they can be taken out of PostgreSQL's commit counter."""

    def __init__(self, settings_dict: dict[str, Any]) -> None:
        self.conn = psycopg.connect(**conninfo(settings_dict), autocommit=True)
        self.transactions = 0

    def one(self, query: str, params: Any = None) -> Any:
        self.transactions += 1
        return self.conn.execute(query, params).fetchone()

    def close(self) -> None:
        self.conn.close()


def stable_commits(settings_dict: dict[str, Any]) -> int:
    """PostgreSQL publishes a backend's counters at its exit or about once a second: read
    until two readings agree."""
    previous = xact_commits(settings_dict)
    for _ in range(20):
        time.sleep(0.3)
        current = xact_commits(settings_dict)
        if current == previous:
            return current
        previous = current
    return previous


def wait_terminal(poller: Poller, run_ids: list[uuid.UUID], timeout: float) -> int:
    ids = [str(run_id) for run_id in run_ids]
    end = time.monotonic() + timeout
    while True:
        (done,) = poller.one(
            "SELECT count(*) FROM runs_run WHERE id = ANY(%s::uuid[]) AND status = ANY(%s)",
            [ids, list(Run.TERMINAL)],
        )
        if done >= len(ids) or time.monotonic() > end:
            return done
        time.sleep(0.1)


# --- 1. the limit: one-row INSERT + COMMIT ---------------------------------------------------


def insert_commit_limit(settings_dict: dict[str, Any], clients: int, seconds: float) -> dict:
    """psycopg, same database, ``clients`` connections: commits/s of a one-row INSERT."""
    with psycopg.connect(**conninfo(settings_dict), autocommit=True) as setup:
        setup.execute(
            "CREATE TABLE IF NOT EXISTS bench_limit (id bigserial PRIMARY KEY, payload text)"
        )
    counts = [0] * clients
    start = threading.Barrier(clients + 1)
    stop = threading.Event()

    def client(index: int) -> None:
        with psycopg.connect(**conninfo(settings_dict)) as conn:
            start.wait()
            while not stop.is_set():
                conn.execute("INSERT INTO bench_limit (payload) VALUES (%s)", ["x"])
                conn.commit()
                counts[index] += 1

    threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    for thread in threads:
        thread.start()
    start.wait()
    began = time.perf_counter()
    time.sleep(seconds)
    stop.set()
    for thread in threads:
        thread.join()
    elapsed = time.perf_counter() - began
    return {"clients": clients, "commits_per_s": round(sum(counts) / elapsed, 1)}


# --- 2. step throughput ----------------------------------------------------------------------


def throughput(ctx: Context, *, agent: str, workers: int, runs: int, steps: int) -> dict:
    """``runs`` runs of ``steps`` no-op tool steps, created (and their wake-ups enqueued)
    before the workers start; steps/s from the first claim to the last finish, in database
    timestamps. CPU of the worker processes and of their PostgreSQL backends per step, and
    PostgreSQL's own commit counter per step."""
    ctx.say(f"throughput: {agent}, {workers} worker(s), {runs} runs x {steps} steps")
    run_ids = create_runs(agent, runs, steps)
    connection.close()  # publish this process's counters before the baseline
    commits_before = stable_commits(ctx.settings_dict)
    poller = Poller(ctx.settings_dict)
    processes = ctx.processes_per_worker(workers)
    started = ctx.start_workers(
        f"tp-{agent.split('.')[-1]}-{workers}", workers, AGENTOPS_Q_WORKERS=str(processes)
    )
    # (PostgreSQL's CPU is measured in the overhead section, on one known backend: here the
    # workers' backends come and go with django-q2's connection recycling and would be lost)
    worker_cpu_before = sum(cpu_seconds(w.group_pids()) for w in started)
    try:
        done = wait_terminal(poller, run_ids, timeout=60 + runs * steps / 10)
        worker_cpu = sum(cpu_seconds(w.group_pids()) for w in started) - worker_cpu_before
    finally:
        for worker in started:
            worker.stop()
    poller.close()
    commits = stable_commits(ctx.settings_dict) - commits_before - poller.transactions
    window = Run.objects.filter(id__in=run_ids).aggregate(last=Max("finished_at"))
    first_claim = RunEvent.objects.filter(run_id__in=run_ids, type=EventType.RUN_CLAIMED).aggregate(
        first=Min("created_at")
    )["first"]
    succeeded = Run.objects.filter(id__in=run_ids, status=Run.Status.SUCCEEDED).count()
    total_steps = runs * steps
    seconds = (
        (window["last"] - first_claim).total_seconds() if window["last"] and first_claim else None
    )
    return {
        "agent": agent,
        "workers": workers,
        "task_processes_per_worker": processes,
        "runs": runs,
        "steps_per_run": steps,
        "succeeded": succeeded,
        "finished": done,
        "seconds": rounded(seconds, 3),
        "steps_per_s": rounded(total_steps / seconds, 1) if seconds else None,
        "commits_per_step": rounded(commits / total_steps),
        "worker_cpu_ms_per_step": rounded(worker_cpu * 1000 / total_steps),
    }


def _proc_stat_cpu() -> list[int] | None:
    """The machine's CPU time counters (``/proc/stat``'s ``cpu`` line): user nice system idle
    iowait irq softirq steal …; None where there is no /proc."""
    try:
        with open("/proc/stat") as stat:
            fields = stat.readline().split()
    except OSError:
        return None
    return [int(value) for value in fields[1:9]] if fields and fields[0] == "cpu" else None


class MachineSample:
    """The machine over a stretch of the benchmark: the load average at its start and end,
    and the share of CPU time that was busy and that the hypervisor stole (``steal``: time a
    virtual CPU waited for a physical one — a noisy neighbour)."""

    def __init__(self) -> None:
        self.load_start = os.getloadavg()[0]
        self.cpu_start = _proc_stat_cpu()

    def end(self) -> dict:
        result: dict[str, Any] = {
            "load_start": round(self.load_start, 2),
            "load_end": round(os.getloadavg()[0], 2),
        }
        cpu_end = _proc_stat_cpu()
        if self.cpu_start and cpu_end:
            delta = [b - a for a, b in zip(self.cpu_start, cpu_end, strict=True)]
            total = sum(delta) or 1
            idle = delta[3] + delta[4]
            result["cpu_busy_pct"] = round(100 * (total - idle) / total, 1)
            result["steal_pct"] = round(100 * delta[7] / total, 2)
        return result


def median(values: list[float]) -> float | None:
    """The median of the values that were measured (None when none was)."""
    present = sorted(v for v in values if v is not None)
    if not present:
        return None
    middle = len(present) // 2
    return present[middle] if len(present) % 2 else (present[middle - 1] + present[middle]) / 2


def spread(values: list[float | None], digits: int = 3) -> dict | None:
    present = [v for v in values if v is not None]
    if not present:
        return None
    return {
        "median": rounded(median(present), digits),
        "min": rounded(min(present), digits),
        "max": rounded(max(present), digits),
    }


def throughput_summary(agent: str, rounds: list[dict]) -> dict:
    """One tool at one concurrency over the interleaved rounds: the medians (what the table
    and the targets read), each ratio's range, and every round with its machine sample."""
    per_round = []
    for r in rounds:
        row = r["rows"][agent]
        peer = r["dbos"] or {}
        limit = r["limit"]["commits_per_s"]
        ours = row["steps_per_s"]
        theirs = peer.get("steps_per_s")
        per_round.append(
            {
                "round": r["round"],
                "steps_per_s": ours,
                "insert_commit_per_s": limit,
                "ratio_to_limit": round(ours / limit, 3) if ours and limit else None,
                "dbos_steps_per_s": theirs,
                "ratio_to_dbos": round(ours / theirs, 3) if ours and theirs else None,
                "commits_per_step": row["commits_per_step"],
                "worker_cpu_ms_per_step": row["worker_cpu_ms_per_step"],
                "succeeded": row["succeeded"],
                **r["machine"],
            }
        )
    first = rounds[0]["rows"][agent]

    def med(key: str, digits: int = 1) -> float | None:
        return rounded(median([p[key] for p in per_round]), digits)

    summary = {
        "agent": agent,
        "workers": first["workers"],
        "task_processes_per_worker": first["task_processes_per_worker"],
        "runs": first["runs"],
        "steps_per_run": first["steps_per_run"],
        "rounds_measured": len(per_round),
        "succeeded": min(p["succeeded"] for p in per_round),
        "finished": min(r["rows"][agent]["finished"] for r in rounds),
        "steps_per_s": med("steps_per_s"),
        "insert_commit_per_s": med("insert_commit_per_s"),
        "ratio_to_limit": med("ratio_to_limit", 3),
        "ratio_to_limit_range": spread([p["ratio_to_limit"] for p in per_round]),
        "commits_per_step": med("commits_per_step", 2),
        "worker_cpu_ms_per_step": med("worker_cpu_ms_per_step", 2),
        "rounds": per_round,
    }
    peers = [r["dbos"] for r in rounds if r["dbos"]]
    measured = [p for p in peers if p.get("steps_per_s")]
    if measured:
        summary["dbos"] = {
            key: rounded(median([p.get(key) for p in measured]), 2)
            for key in ("steps_per_s", "worker_cpu_ms_per_step", "postgres_cpu_ms_per_step")
        }
        summary["ratio_to_dbos"] = spread([p["ratio_to_dbos"] for p in per_round])
    elif peers:
        summary["dbos"] = peers[0]  # {"skipped": why}
    return summary


def table_writes(settings_dict: dict[str, Any]) -> dict:
    """PostgreSQL's per-table write counters over the whole benchmark: how many updates
    were HOT (no index touched) is where the database's CPU per step goes."""
    with psycopg.connect(**conninfo(settings_dict), autocommit=True) as conn:
        # the events are partitioned (runs 0031): their partitions' counters, summed
        rows = conn.execute(
            "SELECT CASE WHEN relname LIKE 'runs\\_runevent\\_%%' THEN 'runs_runevent' "
            "ELSE relname END AS name, sum(n_tup_ins), sum(n_tup_upd), sum(n_tup_hot_upd), "
            "max((SELECT count(*) FROM pg_index i WHERE i.indrelid = s.relid)) "
            "FROM pg_stat_user_tables s WHERE relname = ANY(%s) "
            "OR relname LIKE 'runs\\_runevent\\_%%' GROUP BY 1 ORDER BY 1",
            [["runs_run", "runs_step", "runs_toolcall", "runs_toolreceipt", "runs_runevent"]],
        ).fetchall()
    return {
        name: {
            "inserts": int(ins),
            "updates": int(upd),
            "hot_updates": int(hot),
            "indexes": indexes,
        }
        for name, ins, upd, hot, indexes in rows
    }


# --- 3. checkpoint overhead per step (in this process, exact counts) ---------------------------


class QueryLog:
    """Django's query log at the connection, plus the commits of transactions that wrote:
    a write outside ``atomic()`` is its own (auto)commit."""

    def __init__(self) -> None:
        self.queries = 0
        self.writes_outside_atomic = 0
        self.atomic_commits = 0

    def __call__(self, execute, sql, params, many, context):
        self.queries += 1
        verb = sql.lstrip().split(None, 1)[0].upper()
        if not connection.in_atomic_block and (
            verb in ("INSERT", "UPDATE", "DELETE")
            # a checkpoint's one statement (runs.record.checkpoint): data-modifying CTEs
            or (verb == "WITH" and any(w in sql for w in ("INSERT INTO", "UPDATE ", "DELETE ")))
        ):
            self.writes_outside_atomic += 1
        return execute(sql, params, many, context)

    @property
    def commits(self) -> int:
        return self.atomic_commits + self.writes_outside_atomic

    @contextmanager
    def installed(self) -> Iterator[QueryLog]:
        original = connection.commit

        def counting_commit() -> None:
            self.atomic_commits += 1
            original()

        connection.commit = counting_commit  # type: ignore[method-assign]
        try:
            with connection.execute_wrapper(self):
                yield self
        finally:
            del connection.commit


def overhead(*, agent: str, runs: int, steps: int) -> dict:
    """Sequential runs driven by ``engine.advance`` in this process. A step's overhead is
    the time between two consecutive ``decide()`` calls of one run (the tool is a no-op):
    the decided+dispatching commit, the call, the receipt+step_completed commit. Queries and
    commits are counted exactly, per step and per run (claim, finish: amortised over K)."""
    with no_wakeups():
        run_ids = create_runs(agent, runs, steps)
        agents.decide_marks.clear()
        agents.recording = True
        log = QueryLog()
        with connection.cursor() as cursor:
            cursor.execute("SELECT pg_backend_pid()")
            (backend,) = cursor.fetchone()
        pg_before = cpu_seconds([backend])
        cpu_before = time.process_time()
        try:
            with log.installed():
                for run_id in run_ids:
                    while engine.advance(run_id, worker="bench-inprocess") != "not_claimed":
                        pass
        finally:
            agents.recording = False
        cpu = time.process_time() - cpu_before
        # this process's one backend: what PostgreSQL spent on these steps
        pg_cpu = cpu_seconds([backend]) - pg_before
    gaps, cpu_gaps = [], []
    for marks in agents.decide_marks.values():
        # marks[0] follows the claim; marks[-1] is the decision to finish
        for (wall_a, cpu_a), (wall_b, cpu_b) in zip(marks, marks[1:], strict=False):
            gaps.append((wall_b - wall_a) * 1000)
            cpu_gaps.append((cpu_b - cpu_a) * 1000)
    total_steps = runs * steps
    succeeded = Run.objects.filter(id__in=run_ids, status=Run.Status.SUCCEEDED).count()
    return {
        "agent": agent,
        "runs": runs,
        "steps_per_run": steps,
        "succeeded": succeeded,
        "step_ms_p50": rounded(pct(gaps, 50)),
        "step_ms_p95": rounded(pct(gaps, 95)),
        "step_cpu_ms_p50": rounded(pct(cpu_gaps, 50)),
        "cpu_ms_per_step_all_in": rounded(cpu * 1000 / total_steps),
        "postgres_cpu_ms_per_step": rounded(pg_cpu * 1000 / total_steps),
        "queries_per_step": rounded(log.queries / total_steps),
        "commits_per_step": rounded(log.commits / total_steps),
    }


def steady_state_counts(*, agent: str) -> dict:
    """Queries and commits of one step in the middle of a run, against one whole run of
    one step and of two: the difference is exactly one step."""
    counts = {}
    for steps in (1, 2):
        with no_wakeups():
            (run_id,) = create_runs(agent, 1, steps)
            log = QueryLog()
            with log.installed():
                while engine.advance(run_id, worker="bench-inprocess") != "not_claimed":
                    pass
        counts[steps] = (log.queries, log.commits)
    return {
        "agent": agent,
        "queries_per_step": counts[2][0] - counts[1][0],
        "commits_per_step": counts[2][1] - counts[1][1],
        "queries_per_run_besides_steps": counts[1][0] - (counts[2][0] - counts[1][0]),
        "commits_per_run_besides_steps": counts[1][1] - (counts[2][1] - counts[1][1]),
    }


# --- 4. recovery --------------------------------------------------------------------------


def _hold(ctx: Context, poller: Poller, owner: str, run_ids: list[uuid.UUID], timeout: float):
    ids = [str(run_id) for run_id in run_ids]
    end = time.monotonic() + timeout
    while True:
        (held,) = poller.one(
            "SELECT count(*) FROM runs_run WHERE id = ANY(%s::uuid[]) AND lease_owner = %s "
            "AND status = 'running' AND steps_used >= 1",
            [ids, owner],
        )
        if held >= len(ids):
            return
        if time.monotonic() > end:
            raise RuntimeError(f"worker {owner} did not take all {len(ids)} runs in {timeout}s")
        time.sleep(0.05)


def _first_progress(
    poller: Poller, run_ids: list[uuid.UUID], after: float, timeout: float
) -> list[float | None]:
    """Seconds from ``after`` (epoch) until each run completed a step again."""
    end = time.monotonic() + timeout
    latencies: dict[str, float] = {}
    ids = [str(run_id) for run_id in run_ids]
    while len(latencies) < len(ids) and time.monotonic() < end:
        rows = poller.conn.execute(
            "SELECT run_id::text, min(created_at) FROM runs_runevent WHERE run_id = ANY(%s::uuid[]) "
            "AND type = 'tool.succeeded' AND created_at > to_timestamp(%s) GROUP BY run_id",
            [ids, after],
        ).fetchall()
        poller.transactions += 1
        for run_id, first in rows:
            latencies[run_id] = first.timestamp() - after
        time.sleep(0.02)
    return [latencies.get(run_id) for run_id in ids]


def _stop_runs(run_ids: list[uuid.UUID]) -> None:
    for run_id in run_ids:
        with suppress(services.InvalidState):
            services.run_terminate(run_id=run_id, actor=SYSTEM, reason="benchmark over")


def recovery(ctx: Context, *, held: int, lease_ttl: float, sleep: float) -> dict:
    """SIGKILL one of two workers while it holds ``held`` runs: seconds until each makes
    progress again (a completed step) by the survivor. Then a cold restart: the only
    worker is SIGKILLed and started again under its name: seconds from the start of the
    process to its first completed step."""
    env = {
        "AGENTOPS_LEASE_TTL": str(lease_ttl),
        "AGENTOPS_Q_WORKERS": str(held),
        # one slice for the whole measurement: a run that yields between slices is not held
        "AGENTOPS_SLICE_STEPS": "1000000",
        "AGENTOPS_SLICE_SECONDS": "240",
    }
    poller = Poller(ctx.settings_dict)
    result: dict[str, Any] = {"lease_ttl_s": lease_ttl, "runs_held": held}
    steps = 10_000  # long runs: still in progress whenever they are looked at
    try:
        ctx.say(f"recovery: SIGKILL a worker holding {held} runs, lease TTL {lease_ttl}s")
        (victim,) = ctx.start_workers("rec-victim", 1, **env)
        run_ids = create_runs(agents.SLOW_AGENT, held, steps, sleep=sleep)
        _hold(ctx, poller, victim.name, run_ids, timeout=60)
        (survivor,) = ctx.start_workers("rec-survivor", 1, **env)
        killed_at = time.time()
        victim.kill()
        latencies = _first_progress(poller, run_ids, killed_at, timeout=lease_ttl + 60)
        survivor.stop()
        _stop_runs(run_ids)
        seen = [value for value in latencies if value is not None]
        result["survivor_s"] = [rounded(value) for value in latencies]
        result["survivor_s_max"] = rounded(max(seen)) if len(seen) == len(latencies) else None

        ctx.say("recovery: cold restart of the only worker")
        (only,) = ctx.start_workers("rec-cold", 1, **env)
        run_ids = create_runs(agents.SLOW_AGENT, held, steps, sleep=sleep)
        _hold(ctx, poller, only.name, run_ids, timeout=60)
        only.kill()
        restarted_at = time.time()
        again = BenchWorker(only.name, ctx.worker_env(**env), ctx.log_dir)
        again.wait_running()
        # process start to "worker running" (interpreter, Django, identity, takeover, sweep,
        # cluster start): the part of a cold start that is not the engine's
        result["cold_start_ready_s"] = rounded(time.time() - restarted_at)
        latencies = _first_progress(poller, run_ids, restarted_at, timeout=60)
        again.stop()
        _stop_runs(run_ids)
        seen = [value for value in latencies if value is not None]
        result["cold_start_first_progress_s"] = rounded(min(seen)) if seen else None
        result["cold_start_all_progress_s"] = (
            rounded(max(seen)) if len(seen) == len(latencies) else None
        )
    finally:
        poller.close()
    return result


# --- 5. approval -> dispatch ------------------------------------------------------------------


def approval_dispatch(ctx: Context, *, count: int) -> dict:
    """A person approves (the service an approver's POST calls); the worker woken on commit
    dispatches. Latency: the ``approval.decided`` event's commit to the ``tool.dispatching``
    one, both stamped in the same transaction that commits them. Decided one at a time."""
    from django.contrib.auth import get_user_model
    from django.contrib.auth.models import Group

    from approvals.models import Approval
    from approvals.services import approval_decide

    ctx.say(f"approval -> dispatch: {count} approvals")
    approver = get_user_model().objects.create_user(
        username=f"bench-approver-{uuid.uuid4().hex[:6]}"
    )
    approver.groups.add(Group.objects.get(name="approver"))
    actor = Actor.for_user(approver, "web")
    poller = Poller(ctx.settings_dict)
    (worker,) = ctx.start_workers("approvals", 1)
    latencies = []
    try:
        run_ids = create_runs(agents.APPROVAL_AGENT, count, 1)
        end = time.monotonic() + 60 + count
        while Approval.objects.filter(run_id__in=run_ids, status="pending").count() < count:
            if time.monotonic() > end:
                raise RuntimeError("the approval runs did not all reach waiting_approval")
            time.sleep(0.1)
        for approval in Approval.objects.filter(run_id__in=run_ids).order_by("requested_at"):
            approval_decide(approval_id=approval.id, decision="approve", actor=actor)
            decided = (
                RunEvent.objects.filter(run_id=approval.run_id, type=EventType.APPROVAL_DECIDED)
                .values_list("created_at", flat=True)
                .first()
            )
            deadline = time.monotonic() + 30
            dispatched = None
            while dispatched is None and time.monotonic() < deadline:
                row = poller.one(
                    "SELECT created_at FROM runs_runevent WHERE run_id = %s "
                    "AND type = 'tool.dispatching'",
                    [str(approval.run_id)],
                )
                dispatched = row[0] if row else None
                if dispatched is None:
                    time.sleep(0.005)
            if decided is not None and dispatched is not None:
                latencies.append((dispatched - decided).total_seconds() * 1000)
    finally:
        worker.stop()
        poller.close()
    return {
        "approvals": count,
        "dispatched": len(latencies),
        "ms_p50": rounded(pct(latencies, 50), 1),
        "ms_p95": rounded(pct(latencies, 95), 1),
    }


# --- 6. memory ---------------------------------------------------------------------------


def memory(ctx: Context, *, checkpoints: tuple[int, ...], steps: int) -> dict:
    """One worker runs ``max(checkpoints)`` steps; its RSS (the whole process group: main,
    cluster and task process) is read when each count of completed steps is passed."""
    target = max(checkpoints)
    runs = max(1, target // steps)
    ctx.say(f"memory: worker RSS over {runs * steps} steps")
    run_ids = create_runs(agents.READ_AGENT, runs, steps)
    ids = [str(run_id) for run_id in run_ids]
    poller = Poller(ctx.settings_dict)
    (worker,) = ctx.start_workers("memory", 1)
    samples: dict[str, Any] = {}
    try:
        pending = sorted(checkpoints)
        end = time.monotonic() + 120 + target / 10
        while pending and time.monotonic() < end:
            (done,) = poller.one(
                "SELECT count(*) FROM runs_toolcall WHERE run_id = ANY(%s::uuid[]) "
                "AND status = 'succeeded'",
                [ids],
            )
            while pending and done >= pending[0]:
                pids = worker.group_pids()
                samples[str(pending.pop(0))] = {
                    "steps_done": done,
                    "rss_mb_group": rounded(sum(rss_bytes(pid) for pid in pids) / 2**20, 1),
                    "rss_mb_largest": rounded(max(rss_bytes(pid) for pid in pids) / 2**20, 1),
                }
            time.sleep(0.1)
    finally:
        worker.stop()
        poller.close()
    _stop_runs(run_ids)
    first, last = str(min(checkpoints)), str(target)
    growth = None
    if first in samples and last in samples:
        growth = rounded(
            100 * (samples[last]["rss_mb_group"] / samples[first]["rss_mb_group"] - 1), 1
        )
    return {"samples": samples, "growth_pct": growth}


# --- 7. pages and API ---------------------------------------------------------------------------


def seed_runs(count: int, template_id: uuid.UUID) -> None:
    """``count`` copies of a finished run, in one INSERT ... SELECT: a realistic table size
    for the list pages, in seconds. Statuses and ages are spread like a real console's."""
    fields = [f for f in Run._meta.concrete_fields]
    columns = ", ".join(connection.ops.quote_name(f.column) for f in fields)
    overrides = {
        "id": "g.new_id",
        "root_run_id": "g.new_id",
        "trace_id": "md5(g.new_id::text)",
        "status": "(ARRAY['succeeded','succeeded','succeeded','failed','running','queued',"
        "'waiting_approval','needs_attention','paused','terminated'])[1 + mod(g.n, 10)]",
        "created_at": "t.created_at - make_interval(secs => g.n)",
        "updated_at": "t.updated_at - make_interval(secs => g.n)",
    }
    select = ", ".join(
        overrides.get(f.column, f"t.{connection.ops.quote_name(f.column)}") for f in fields
    )
    with connection.cursor() as cursor:
        cursor.execute(
            f"INSERT INTO {Run._meta.db_table} ({columns}) SELECT {select} FROM "
            f"{Run._meta.db_table} t, (SELECT gen_random_uuid() AS new_id, n FROM "
            "generate_series(1, %s) n) g WHERE t.id = %s",
            [count, str(template_id)],
        )


PAGES = (
    # (label, URL name, needs the big run's id, API)
    ("dashboard", "runs:dashboard", False),
    ("runs list", "runs:list", False),
    ("run detail (1 run of N steps)", "runs:detail", True),
    ("GET /api/v1/runs/", "api:runs", False),
    ("GET /api/v1/runs/{id}/", "api:run", True),
)


def _urls(big_run_id: uuid.UUID) -> list[tuple[str, str | None]]:
    from django.urls import NoReverseMatch, reverse

    urls = []
    for label, name, with_id in PAGES:
        try:
            url = reverse(name, kwargs={"run_id": big_run_id} if with_id else None)
        except NoReverseMatch:
            url = None  # a page this checkout does not have yet: reported, not failed
        urls.append((label, url))
    return urls


def _time_pages(client: Any, urls: list[tuple[str, str | None]], repeat: int) -> dict:
    figures = {}
    for label, url in urls:
        if url is None:
            figures[label] = {"url": None, "error": "no such page in this checkout"}
            continue
        response = client.get(url, secure=True)  # warm: templates, first-query costs
        if response.status_code != 200:
            figures[label] = {"url": url, "error": f"HTTP {response.status_code}"}
            continue
        log = QueryLog()  # an execute wrapper: independent of DEBUG and its bounded log
        with log.installed():
            client.get(url, secure=True)
        times = []
        for _ in range(repeat):
            began = time.perf_counter()
            client.get(url, secure=True)
            times.append((time.perf_counter() - began) * 1000)
        figures[label] = {
            "url": url,
            "queries": log.queries,
            "ms_p50": rounded(pct(times, 50), 1),
            "ms_p95": rounded(pct(times, 95), 1),
        }
    return figures


def pages(ctx: Context, *, runs: int, big_steps: int, repeat: int) -> tuple[dict, str]:
    """Server time (Django test client, in process: routing, middleware, views, templates,
    queries) and query counts, first with a handful of runs and then with ``runs`` runs and
    one run of ``big_steps`` steps: equal query counts mean they do not grow with rows.
    Also returns a signed-in session cookie for the load against gunicorn."""
    from django.contrib.auth import get_user_model
    from django.test import Client
    from django.test.utils import override_settings

    ctx.say(f"pages: a run of {big_steps} steps, then {runs} runs")
    with no_wakeups():
        (big_run,) = create_runs(agents.READ_AGENT, 1, big_steps)
        while engine.advance(big_run, worker="bench-inprocess") != "not_claimed":
            pass
    user = get_user_model().objects.create_superuser(
        username=f"bench-admin-{uuid.uuid4().hex[:6]}", password=None
    )
    with override_settings(ALLOWED_HOSTS=["testserver"]):
        client = Client(raise_request_exception=False)  # a broken page is reported, not fatal
        client.force_login(user)
        urls = _urls(big_run)
        small = _time_pages(client, urls, repeat=max(3, repeat // 5))
        began = time.perf_counter()
        seed_runs(max(0, runs - Run.objects.count()), big_run)
        seeded_in = time.perf_counter() - began
        with connection.cursor() as cursor:
            # what autovacuum does to a table that grew over time (the copies arrived in one
            # statement here): statistics, and the visibility map index-only scans rely on
            # (inside a transaction — the test suite's in-place run — statistics only)
            cursor.execute("ANALYZE" if connection.in_atomic_block else "VACUUM (ANALYZE)")
        large = _time_pages(client, urls, repeat=repeat)
    for label, figures in large.items():
        before = small.get(label, {}).get("queries")
        if "queries" in figures and before is not None:
            figures["queries_with_few_rows"] = before
            figures["queries_constant"] = before == figures["queries"]
    figures = {
        "runs_in_table": Run.objects.count(),
        "big_run_steps": big_steps,
        "seeded_in_s": rounded(seeded_in, 1),
        "pages": large,
    }
    return figures, client.cookies["sessionid"].value


def http_load(
    ctx: Context, *, urls: dict[str, str], cookie: str, seconds: float, clients: int, port: int
) -> dict:
    """Requests/s against gunicorn (2 sync workers, the Procfile's web process) with
    ``clients`` concurrent keep-alive connections from a small threaded client."""
    import httpx

    from agentops.bench.procs import gunicorn

    ctx.say(f"http: gunicorn, {clients} clients, {seconds}s per URL")
    server = gunicorn(ctx, port=port)
    results = {}
    try:
        for label, url in urls.items():
            counts = [0] * clients
            errors = [0] * clients
            stop = threading.Event()

            def client(
                index: int,
                url: str = url,
                stop: threading.Event = stop,
                counts: list[int] = counts,
                errors: list[int] = errors,
            ) -> None:
                with httpx.Client(
                    base_url=f"http://127.0.0.1:{port}", cookies={"sessionid": cookie}
                ) as http:
                    while not stop.is_set():
                        response = http.get(url)
                        if response.status_code == 200:
                            counts[index] += 1
                        else:
                            errors[index] += 1

            threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
            began = time.perf_counter()
            for thread in threads:
                thread.start()
            time.sleep(seconds)
            stop.set()
            for thread in threads:
                thread.join()
            elapsed = time.perf_counter() - began
            results[label] = {
                "url": url,
                "requests_per_s": rounded(sum(counts) / elapsed, 1),
                "errors": sum(errors),
            }
    finally:
        server.stop()
    return results

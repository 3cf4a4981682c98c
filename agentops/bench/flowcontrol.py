"""The flow section of ``manage.py bench`` (issue 26; docs/benchmarks.md, "Flow control").

Two questions, each answered on real ``runworker`` processes:

1. What does a per-tool limit cost when it does not bind? The throughput section's method
   (W runs of K no-op ``idempotent`` steps, created before the workers start; steps/s from
   the first claim to the last finish; PostgreSQL's commit counter per step), run with no
   limit and with an operator's limit far above what the workers can reach, in interleaved
   rounds; and the exact statements and commits of one step, in process, both ways.
2. Does a binding limit hold where it matters, at the downstream? Runs whose tool refunds a
   cent at the sandbox payments service (``agentops.demo.sandbox``), which holds each
   refund a few milliseconds and counts the refunds it is handling at once: its own
   maximum, not our record's, must equal the limit. Once without the limit first (the same
   workers reach more than it: the limit is what holds them), then with it.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import httpx
from django.db import connection
from django.db.models import Max, Min

from agentops.bench import agents, measure
from agentops.bench.measure import (
    SYSTEM,
    Context,
    Poller,
    create_runs,
    rounded,
    stable_commits,
    wait_terminal,
)
from runs import flow
from runs.models import Run, RunEvent
from runs.record.eventtypes import EventType

# "well above what the workers reach": the throughput runs have as many task processes as
# the machine has cores, so at most that many calls are ever in flight
NOT_BINDING = 1000


@contextmanager
def tool_limit(tool_name: str, max_in_flight: int | None) -> Iterator[None]:
    """An operator's limit on ``tool_name`` while the block runs (none for None): set and
    removed through the audited services, read by every worker at its claims."""
    if max_in_flight is None:
        yield
        return
    flow.tool_limit_set(
        tool_name=tool_name, max_in_flight=max_in_flight, actor=SYSTEM, reason="bench"
    )
    try:
        yield
    finally:
        flow.tool_limit_remove(tool_name=tool_name, actor=SYSTEM, reason="bench over")


# --- 1. a limit that does not bind --------------------------------------------------------


def limit_overhead(ctx: Context, *, runs: int, steps: int, rounds: int) -> dict:
    """The ``idempotent`` no-op tool with 2 workers, with no limit and with an operator's
    limit of ``NOT_BINDING`` calls in flight, alternately (odd rounds unlimited first): the
    median of the rounds' ratios decides, as the throughput section's ratio to DBOS does."""
    agent = agents.IDEMPOTENT_AGENT
    tool = agents.IdempotentAgent.tool_name
    per_round = []
    for number in range(1, rounds + 1):
        machine = measure.MachineSample()
        order = (None, NOT_BINDING) if number % 2 else (NOT_BINDING, None)
        rows: dict[Any, dict] = {}
        for limit in order:
            ctx.say(f"flow: {'no limit' if limit is None else f'limit {limit} in flight'}")
            with tool_limit(tool, limit):
                rows[limit] = measure.throughput(
                    ctx, agent=agent, workers=2, runs=runs, steps=steps
                )
        free, limited = rows[None], rows[NOT_BINDING]
        per_round.append(
            {
                "round": number,
                "unlimited": _figures(free),
                "limited": _figures(limited),
                "ratio": (
                    round(limited["steps_per_s"] / free["steps_per_s"], 3)
                    if limited["steps_per_s"] and free["steps_per_s"]
                    else None
                ),
                **machine.end(),
            }
        )
    counts = {"unlimited": measure.steady_state_counts(agent=agent)}
    with tool_limit(tool, NOT_BINDING):
        counts["limited"] = measure.steady_state_counts(agent=agent)

    def med(side: str, key: str, digits: int = 1) -> float | None:
        return rounded(measure.median([r[side][key] for r in per_round]), digits)

    return {
        "agent": agent,
        "workers": 2,
        "task_processes_per_worker": ctx.processes_per_worker(2),
        "runs": runs,
        "steps_per_run": steps,
        "max_in_flight": NOT_BINDING,
        "rounds_measured": len(per_round),
        "succeeded": min(
            min(r["unlimited"]["succeeded"], r["limited"]["succeeded"]) for r in per_round
        ),
        **{
            side: {
                "steps_per_s": med(side, "steps_per_s"),
                # everything the workers committed (the throughput section's count)
                "commits_per_step": med(side, "commits_per_step", 2),
                "worker_cpu_ms_per_step": med(side, "worker_cpu_ms_per_step", 2),
                # one step in the middle of a run, counted exactly in process
                "queries_per_step": counts[side]["queries_per_step"],
                "commits_per_step_exact": counts[side]["commits_per_step"],
            }
            for side in ("unlimited", "limited")
        },
        "ratio": measure.spread([r["ratio"] for r in per_round]),
        "rounds": per_round,
    }


def _figures(row: dict) -> dict:
    return {
        key: row[key]
        for key in ("steps_per_s", "commits_per_step", "worker_cpu_ms_per_step", "succeeded")
    }


# --- 2. a binding limit, as the downstream sees it -----------------------------------------


def binding_limit(
    ctx: Context, *, runs: int, steps: int, limit: int, latency_ms: int, processes: int
) -> dict:
    """``runs`` runs of ``steps`` one-cent refunds at the sandbox, 2 workers of
    ``processes`` task processes each (more calls could be in flight than the limit allows),
    first without a limit, then with ``limit`` calls in flight. The sandbox holds each
    refund ``latency_ms`` and reports the most it handled at once."""
    from agentops.demo.sandbox import start_sandbox

    ctx.say(f"flow: sandbox for the binding limit ({latency_ms} ms per refund)")
    sandbox = start_sandbox(ctx.log_dir / "flow-sandbox.sqlite3", mode="dedupe")
    env = {
        "AGENTOPS_Q_WORKERS": str(processes),
        agents.SANDBOX_URL_ENV: sandbox.url,
        agents.SANDBOX_LATENCY_ENV: str(latency_ms),
    }
    try:
        control = _sandbox_runs(ctx, sandbox.url, env, runs=runs, steps=steps, limit=None)
        limited = _sandbox_runs(ctx, sandbox.url, env, runs=runs, steps=steps, limit=limit)
    finally:
        sandbox.stop()
    return {
        "agent": agents.SANDBOX_AGENT,
        "workers": 2,
        "task_processes_per_worker": processes,
        "runs": runs,
        "steps_per_run": steps,
        "latency_ms": latency_ms,
        "max_in_flight": limit,
        # the most calls the limit and the sandbox's latency allow per second
        "ceiling_calls_per_s": round(limit * 1000 / latency_ms, 1),
        "unlimited": control,
        "limited": limited,
    }


def _sandbox_runs(
    ctx: Context, url: str, env: dict[str, str], *, runs: int, steps: int, limit: int | None
) -> dict:
    with httpx.Client(base_url=url, timeout=10) as sandbox:
        sandbox.post("/reset").raise_for_status()  # its ledger and its in-flight maximum
        with tool_limit(agents.SANDBOX_TOOL, limit):
            ctx.say(
                f"flow: {runs} runs x {steps} sandbox refunds, "
                f"{'no limit' if limit is None else f'limit {limit} in flight'}"
            )
            run_ids = create_runs(agents.SANDBOX_AGENT, runs, steps)
            connection.close()  # publish this process's counters before the baseline
            commits_before = stable_commits(ctx.settings_dict)
            poller = Poller(ctx.settings_dict)
            workers = ctx.start_workers(f"flow-{'free' if limit is None else limit}", 2, **env)
            try:
                done = wait_terminal(poller, run_ids, timeout=60 + runs * steps / 5)
            finally:
                for worker in workers:
                    worker.stop()
            poller.close()
            commits = stable_commits(ctx.settings_dict) - commits_before - poller.transactions
        summary = sandbox.get("/requests/summary").json()
    calls = runs * steps
    seconds = _window(run_ids)
    return {
        "succeeded": Run.objects.filter(id__in=run_ids, status=Run.Status.SUCCEEDED).count(),
        "finished": done,
        "seconds": rounded(seconds, 3),
        "steps_per_s": rounded(calls / seconds, 1) if seconds else None,
        "commits_per_step": rounded(commits / calls),
        # the downstream's own view: the most refunds it handled at once, how many it got
        "sandbox_max_in_flight": summary["max_in_flight_by_path"].get("/refunds", 0),
        "sandbox_requests": summary["requests"],
        "sandbox_requests_per_s": summary["requests_per_second"].get("/refunds"),
        "sandbox_peak_requests_per_s": summary["peak_requests_per_second"],
        # our record's view, beside it: how often a run waited for capacity, and the most
        # calls holding a slot when one was granted
        "waits_for_capacity": RunEvent.objects.filter(
            run_id__in=run_ids, type=EventType.RUN_WAITING, payload__on="capacity"
        ).count(),
        "record_max_in_flight_at_grant": _max_in_flight_at_grant(run_ids),
    }


def _window(run_ids: list[uuid.UUID]) -> float | None:
    """First claim to last finish, in database time (the throughput section's window)."""
    last = Run.objects.filter(id__in=run_ids).aggregate(last=Max("finished_at"))["last"]
    first = RunEvent.objects.filter(run_id__in=run_ids, type=EventType.RUN_CLAIMED).aggregate(
        first=Min("created_at")
    )["first"]
    return (last - first).total_seconds() if last and first else None


def _max_in_flight_at_grant(run_ids: list[uuid.UUID]) -> int | None:
    grants = RunEvent.objects.filter(
        run_id__in=run_ids, type=EventType.TOOL_CAPACITY_GRANTED
    ).values_list("payload", flat=True)
    return max((int(payload.get("in_flight", 0)) for payload in grants), default=None)

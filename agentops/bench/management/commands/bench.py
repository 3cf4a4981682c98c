"""``python manage.py bench [--quick]``: the engine measured against its physical limit.

On PostgreSQL only (on SQLite it exits non-zero with one line). It creates a dedicated
database ``<name>_bench`` on the server ``DATABASE_URL`` names, migrates it, measures, drops
it, prints a table and writes ``bench/results/<date>-<host>.json``. What each figure means
and how to read it: docs/benchmarks.md.

``--worker NAME`` is the worker the benchmark starts: the no-op bench agents registered,
then the ordinary ``runworker``. The app itself never registers them.
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import socket
import subprocess
import tempfile
import time
from contextlib import nullcontext
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from django.conf import settings
from django.core.management import call_command
from django.core.management.base import BaseCommand, CommandError
from django.db import OperationalError, connection, connections

from agentops.bench import agents, flowcontrol, measure, scale
from agentops.bench.database import NotPostgres, bench_database, database_url, require_postgres

# (quick, full): the sizes are the full ones
SIZES = {
    "runs": (100, 500),
    "steps": (10, 10),
    "overhead_runs": (30, 200),
    "approvals": (10, 40),
    "held": (2, 4),
    "lease_ttl": (3.0, 5.0),
    "memory_steps": ((200, 2_000), (1_000, 10_000)),
    "page_runs": (5_000, 100_000),
    "page_steps": (100, 1_000),
    "page_repeat": (10, 30),
    "http_seconds": (2.0, 5.0),
    "limit_seconds": (1.0, 3.0),
    # throughput rounds: ours and DBOS's interleaved, the median ratio and its range reported
    "rounds": (1, 3),
    # the scale section (--only scale): a year of history (docs/benchmarks.md, "Scale")
    "scale_runs": (20_000, 1_000_000),
    "scale_events": (200_000, 10_000_000),
    "scale_big_events": (2_000, 10_000),
    "scale_repeat": (10, 30),
    # the flow section (--only flow): the binding limit's runs of K sandbox refunds, the
    # limit, how long the sandbox holds each refund, and each worker's task processes (more
    # than the limit: the workers could have more calls in flight than it allows)
    "flow_runs": (30, 100),
    "flow_limit": (2, 2),
    "flow_latency_ms": (5, 5),
    "flow_task_processes": (4, 4),
}
SECTIONS = ("throughput", "overhead", "recovery", "approval", "memory", "pages", "http")
# sections only --only names: make bench without them stays as fast as it was
OPTIONAL_SECTIONS = ("scale", "flow")
# DBOS Transact 3.4.0 on this kind of machine (../shared/peers/README.md), used when DBOS
# is not measured in the same run
DBOS_REFERENCE = {"steps_per_s_1": 207.0, "steps_per_s_2": 224.0, "step_ms_p50": 5.2}


class Command(BaseCommand):
    help = "Benchmark the engine, recovery, approvals and pages against their limits."

    def add_arguments(self, parser):
        parser.add_argument("--quick", action="store_true", help="small sizes (about 2 minutes)")
        parser.add_argument("--runs", type=int, help="W: runs per throughput measurement")
        parser.add_argument("--steps", type=int, help="K: tool steps per run")
        parser.add_argument("--overhead-runs", type=int, help="sequential runs for overhead")
        parser.add_argument("--approvals", type=int, help="approvals for approval -> dispatch")
        parser.add_argument("--held", type=int, help="runs a killed worker holds")
        parser.add_argument("--lease-ttl", type=float, help="lease TTL for the recovery runs")
        parser.add_argument(
            "--memory-steps", type=int, nargs=2, metavar=("FIRST", "LAST"), help="RSS read at"
        )
        parser.add_argument("--page-runs", type=int, help="runs in the table for the pages")
        parser.add_argument("--page-steps", type=int, help="steps of the big run for its page")
        parser.add_argument("--page-repeat", type=int, help="requests timed per page")
        parser.add_argument("--http-seconds", type=float, help="load per URL against gunicorn")
        parser.add_argument("--limit-seconds", type=float, help="INSERT+COMMIT loop length")
        parser.add_argument(
            "--rounds",
            type=int,
            help="throughput rounds, ours and DBOS's interleaved (default 3; 1 with --quick)",
        )
        parser.add_argument("--scale-runs", type=int, help="scale: runs in the record")
        parser.add_argument("--scale-events", type=int, help="scale: events in the record")
        parser.add_argument("--scale-big-events", type=int, help="scale: events of the big run")
        parser.add_argument("--scale-repeat", type=int, help="scale: timings per read")
        parser.add_argument("--flow-runs", type=int, help="flow: runs under the binding limit")
        parser.add_argument("--flow-limit", type=int, help="flow: the binding limit (in flight)")
        parser.add_argument(
            "--flow-latency-ms", type=int, help="flow: the sandbox's time per refund"
        )
        parser.add_argument(
            "--flow-task-processes",
            type=int,
            help="flow: task processes per worker under the binding limit",
        )
        parser.add_argument(
            "--only",
            help=f"comma-separated sections (default all but {', '.join(OPTIONAL_SECTIONS)}): "
            f"{', '.join(SECTIONS + OPTIONAL_SECTIONS)}",
        )
        parser.add_argument("--output", help="JSON path (default bench/results/<date>-<host>.json)")
        parser.add_argument(
            "--dbos",
            action="store_true",
            help="also run the DBOS peer (../shared/peers) alternately with the throughput runs",
        )
        parser.add_argument(
            "--in-place",
            action="store_true",
            help="measure in the configured database as it is (already migrated; the test "
            "suite uses this) instead of a dedicated one",
        )
        parser.add_argument(
            "--task-processes",
            type=int,
            help="django-q2 task processes per worker in the throughput runs (default: as "
            "many in all as the machine has cores)",
        )
        parser.add_argument("--keep-database", action="store_true", help="do not drop it")
        parser.add_argument("--worker", metavar="NAME", help="(internal) run a bench worker")

    def handle(self, *args, **options):
        if options["worker"]:
            agents.register()
            call_command("runworker", name=options["worker"])
            return
        try:
            require_postgres()
            connection.ensure_connection()
        except NotPostgres as exc:
            raise CommandError(str(exc)) from None
        except OperationalError as exc:
            # e.g. DATABASE_URL names a database that does not exist: one line, not a traceback
            first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
            raise CommandError(
                f"cannot connect to the database DATABASE_URL names: {first}"
            ) from None
        only = set(SECTIONS)
        if options["only"]:
            only = {name.strip() for name in options["only"].split(",") if name.strip()}
            unknown = only - set(SECTIONS) - set(OPTIONAL_SECTIONS)
            if unknown:
                raise CommandError(f"unknown sections: {', '.join(sorted(unknown))}")
        size = {key: values[0 if options["quick"] else 1] for key, values in SIZES.items()}
        for key in size:
            if options.get(key) is not None:
                size[key] = tuple(options[key]) if key == "memory_steps" else options[key]
        if size["runs"] < 1 or size["steps"] < 1 or size["rounds"] < 1:
            raise CommandError("--runs, --steps and --rounds must be at least 1")
        if min(size["flow_runs"], size["flow_limit"], size["flow_latency_ms"]) < 1 or (
            size["flow_task_processes"] < 1
        ):
            raise CommandError(
                "--flow-runs, --flow-limit, --flow-latency-ms and --flow-task-processes "
                "must be at least 1"
            )
        if min(size["scale_runs"], size["scale_big_events"], size["scale_repeat"]) < 1 or (
            size["scale_events"] < 2 * size["scale_runs"]
        ):
            raise CommandError(
                "--scale-runs, --scale-big-events and --scale-repeat must be at least 1, "
                "--scale-events at least twice --scale-runs"
            )
        self._task_processes = options["task_processes"]
        if self._task_processes is not None and self._task_processes < 1:
            raise CommandError("--task-processes must be at least 1")

        agents.register()
        log_dir = Path(tempfile.mkdtemp(prefix="agentops-bench-"))
        began = time.monotonic()
        meta = self._meta(options, size, only)
        database = (
            nullcontext(connection.settings_dict["NAME"])
            if options["in_place"]
            else (bench_database(keep=options["keep_database"]))
        )
        try:
            with database as name:
                self._say(f"database {name}; worker logs in {log_dir}")
                ctx = measure.Context(
                    log_dir=log_dir,
                    worker_env=self._worker_env,
                    settings_dict=connections["default"].settings_dict,
                    say=self._say,
                    task_processes=self._task_processes,
                )
                results = self._measure(ctx, size, only, dbos=options["dbos"])
        finally:
            agents.unregister()
        meta["elapsed_s"] = round(time.monotonic() - began, 1)
        meta["load_average_end"] = list(os.getloadavg())
        report = {"meta": meta, "results": results, "targets": targets(results)}
        path = self._write(report, options)
        self.stdout.write(table(report))
        self.stdout.write(f"\nwritten to {path}")
        failed = [
            name for name, value in results.items() if isinstance(value, dict) and "error" in value
        ]
        if failed:
            self.stderr.write(f"failed: {', '.join(failed)}; worker logs kept in {log_dir}")
        else:
            shutil.rmtree(log_dir, ignore_errors=True)

    # --- pieces -------------------------------------------------------------------------

    def _say(self, message: str) -> None:
        self.stderr.write(f"[bench {datetime.now(UTC):%H:%M:%S}] {message}")
        self.stderr.flush()

    def _worker_env(self, **overrides: str) -> dict[str, str]:
        env = dict(os.environ)
        env.pop("AGENTOPS_CRASH_AT", None)
        env.update(
            {
                "DJANGO_SETTINGS_MODULE": os.environ.get(
                    "DJANGO_SETTINGS_MODULE", "agentops.settings"
                ),
                "DATABASE_URL": database_url(connections["default"].settings_dict),
                "PYTHONUNBUFFERED": "1",
                "LOG_LEVEL": "WARNING",
                "AGENTOPS_Q_SYNC": "0",
                # the deployment's, unless --task-processes (throughput sets its own)
                "AGENTOPS_Q_WORKERS": str(
                    getattr(self, "_task_processes", None) or settings.Q_CLUSTER["workers"]
                ),
                "SECRET_KEY": settings.SECRET_KEY,
                "ALLOWED_HOSTS": ",".join(settings.ALLOWED_HOSTS),
            }
        )
        env.update(overrides)
        return env

    def _meta(self, options: dict, size: dict, only: set[str]) -> dict:
        with connection.cursor() as cursor:
            cursor.execute("SHOW server_version")
            (pg_version,) = cursor.fetchone()
            cursor.execute("SHOW synchronous_commit")
            (sync_commit,) = cursor.fetchone()
        try:
            commit = subprocess.run(
                ["git", "rev-parse", "--short", "HEAD"],
                cwd=settings.BASE_DIR,
                capture_output=True,
                text=True,
                timeout=5,
            ).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            commit = ""
        import django

        return {
            "date": datetime.now(UTC).isoformat(timespec="seconds"),
            "host": socket.gethostname(),
            "cpus": os.cpu_count(),
            "cpu_model": _cpu_model(),
            "load_average_start": list(os.getloadavg()),
            "python": platform.python_version(),
            "django": django.get_version(),
            "postgresql": pg_version,
            "synchronous_commit": sync_commit,
            "git_commit": commit,
            "quick": options["quick"],
            "sections": sorted(only),
            "sizes": size,
            "task_processes_per_worker": self._task_processes or "cores / workers",
            "debug": settings.DEBUG,
        }

    def _throughput_round(
        self,
        ctx: measure.Context,
        workers: int,
        runs: int,
        steps: int,
        size: dict,
        dbos: bool,
        number: int,
    ) -> dict:
        """One round at one concurrency: the INSERT+COMMIT limit, DBOS and both of our tools,
        with the machine's load and CPU steal over the round. Odd rounds run DBOS first, even
        rounds ours first, so a machine that slows down or speeds up during a round does not
        always favour the same side."""
        machine = measure.MachineSample()
        limit = measure.insert_commit_limit(ctx.settings_dict, workers, size["limit_seconds"])

        def ours() -> dict:
            return {
                agent: measure.throughput(ctx, agent=agent, workers=workers, runs=runs, steps=steps)
                for agent in (agents.READ_AGENT, agents.IDEMPOTENT_AGENT)
            }

        def peer() -> dict | None:
            return dbos_throughput(ctx, workers, runs, steps) if dbos else None

        if number % 2:
            dbos_row = peer()
            rows = ours()
        else:
            rows = ours()
            dbos_row = peer()
        return {
            "round": number,
            "workers": workers,
            "limit": limit,
            "dbos": dbos_row,
            "rows": rows,
            "machine": machine.end(),
        }

    def _measure(self, ctx: measure.Context, size: dict, only: set[str], *, dbos: bool) -> dict:
        results: dict[str, Any] = {}
        runs, steps = size["runs"], size["steps"]
        if "throughput" in only:
            rows = []
            for workers in (1, 2):
                rounds = [
                    self._throughput_round(ctx, workers, runs, steps, size, dbos, number)
                    for number in range(1, size["rounds"] + 1)
                ]
                rows += [
                    measure.throughput_summary(agent, rounds)
                    for agent in (agents.READ_AGENT, agents.IDEMPOTENT_AGENT)
                ]
            results["throughput"] = rows
            connection.close()  # publish this process's counters too
            time.sleep(1)
            results["table_writes"] = measure.table_writes(ctx.settings_dict)
        if "overhead" in only:
            results["overhead"] = [
                measure.overhead(agent=agent, runs=size["overhead_runs"], steps=steps)
                for agent in (agents.READ_AGENT, agents.IDEMPOTENT_AGENT)
            ]
            results["per_step_counts"] = [
                measure.steady_state_counts(agent=agent)
                for agent in (agents.READ_AGENT, agents.IDEMPOTENT_AGENT)
            ]
        if "recovery" in only:
            results["recovery"] = self._section(
                ctx,
                "recovery",
                lambda: measure.recovery(
                    ctx, held=size["held"], lease_ttl=size["lease_ttl"], sleep=0.05
                ),
            )
        if "approval" in only:
            results["approval"] = self._section(
                ctx, "approval", lambda: measure.approval_dispatch(ctx, count=size["approvals"])
            )
        if "memory" in only:
            results["memory"] = self._section(
                ctx,
                "memory",
                lambda: measure.memory(ctx, checkpoints=tuple(size["memory_steps"]), steps=steps),
            )
        if "pages" in only or "http" in only:
            pages, cookie = measure.pages(
                ctx,
                runs=size["page_runs"],
                big_steps=size["page_steps"],
                repeat=size["page_repeat"],
            )
            results["pages"] = pages
            if "http" in only:
                urls = {
                    label: figures["url"]
                    for label, figures in pages["pages"].items()
                    if figures.get("url") and "error" not in figures
                }
                results["http"] = measure.http_load(
                    ctx,
                    urls=urls,
                    cookie=cookie,
                    seconds=size["http_seconds"],
                    clients=4,
                    port=_free_port(),
                )
        if "flow" in only:
            results["flow"] = self._section(
                ctx,
                "flow",
                lambda: {
                    "not_binding": flowcontrol.limit_overhead(
                        ctx, runs=runs, steps=steps, rounds=size["rounds"]
                    ),
                    "binding": flowcontrol.binding_limit(
                        ctx,
                        runs=size["flow_runs"],
                        steps=steps,
                        limit=size["flow_limit"],
                        latency_ms=size["flow_latency_ms"],
                        processes=size["flow_task_processes"],
                    ),
                },
            )
        if "scale" in only:
            results["scale"] = scale.scale(
                ctx.say,
                runs=size["scale_runs"],
                events=size["scale_events"],
                big_events=size["scale_big_events"],
                repeat=size["scale_repeat"],
            )
        return results

    def _section(self, ctx: measure.Context, name: str, run: Any) -> dict:
        """A section whose workers fail (a slow machine, a crashed process) is reported with
        its error and the log directory; the other sections still run and are written."""
        try:
            return run()
        except (measure.WorkerFailed, RuntimeError) as exc:
            ctx.say(f"{name} failed: {exc}")
            return {"error": f"{exc} (logs: {ctx.log_dir})"}

    def _write(self, report: dict, options: dict) -> Path:
        if options["output"]:
            path = Path(options["output"])
        else:
            stamp = datetime.now(UTC).strftime("%Y-%m-%d")
            suffix = "-quick" if options["quick"] else ""
            path = (
                Path(settings.BASE_DIR)
                / "bench"
                / "results"
                / (f"{stamp}-{socket.gethostname()}{suffix}.json")
            )
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(report, indent=2, default=str) + "\n")
        return path


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# --- DBOS, side by side ----------------------------------------------------------------------


def dbos_throughput(ctx: measure.Context, workers: int, runs: int, steps: int) -> dict:
    """The peer's own script (../shared/peers/dbos_steps.py), same shape and concurrency, on
    the same PostgreSQL server, when its virtualenv exists (its README says how to make it)."""
    peers = Path(
        os.environ.get("AGENTOPS_PEERS_DIR", Path(settings.BASE_DIR).parent / "shared/peers")
    )
    python = Path(os.environ.get("DBOS_PYTHON", "/tmp/dbos-venv/bin/python"))
    script = peers / "dbos_steps.py"
    if not script.exists() or not python.exists():
        return {"skipped": f"no DBOS peer ({script} with {python})"}
    ctx.say(f"throughput: DBOS, {workers} process(es), {runs} workflows x {steps} steps")
    server = {**ctx.settings_dict, "NAME": "postgres"}
    env = dict(os.environ)
    env.update(
        {
            "PEER_PG_DSN": database_url(server),
            "PEER_DBOS_DB": f"{ctx.settings_dict['NAME']}_dbos"[:63],
        }
    )
    completed = subprocess.run(
        [
            str(python),
            str(script),
            "throughput",
            "--procs",
            str(workers),
            "-w",
            str(runs),
            "-k",
            str(steps),
            "--reps",
            "1",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    if completed.returncode != 0:
        return {"skipped": f"DBOS run failed: {completed.stderr.strip().splitlines()[-1:]}"}
    try:
        out = json.loads(completed.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        return {"skipped": "DBOS printed no result"}
    from psycopg import sql

    from agentops.bench.database import admin_connect

    with admin_connect(ctx.settings_dict) as admin:
        admin.execute(
            sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(
                sql.Identifier(env["PEER_DBOS_DB"])
            )
        )
    return {
        key: out.get(key)
        for key in ("steps_per_s", "worker_cpu_ms_per_step", "postgres_cpu_ms_per_step")
    }


# --- targets and the table -------------------------------------------------------------------


def _check(name: str, value: Any, limit: Any, holds: bool | None, note: str = "") -> dict:
    return {"target": name, "value": value, "limit": limit, "holds": holds, "note": note}


def targets(results: dict) -> list[dict]:
    checks = []
    rows = {(row["agent"], row["workers"]): row for row in results.get("throughput", [])}
    for agent, factor, label in (
        (agents.READ_AGENT, 2.0, "read steps/s, 2 workers >= 2x DBOS"),
        (agents.IDEMPOTENT_AGENT, 1.0, "idempotent steps/s, 2 workers >= DBOS"),
    ):
        row = rows.get((agent, 2))
        if row is None:
            continue
        ratio = row.get("ratio_to_dbos")
        if ratio:
            # the median of the rounds' ratios, each measured side by side with DBOS
            checks.append(
                _check(
                    label,
                    ratio["median"],
                    factor,
                    ratio["median"] >= factor,
                    f"median ratio to DBOS over {row.get('rounds_measured', 1)} interleaved "
                    f"round(s), range {ratio['min']}-{ratio['max']}",
                )
            )
            continue
        reference = DBOS_REFERENCE["steps_per_s_2"]
        value = row["steps_per_s"]
        checks.append(
            _check(
                label,
                value,
                round(factor * reference, 1),
                None if value is None else value >= factor * reference,
                "DBOS from ../shared/peers/README.md (not measured in this run)",
            )
        )
    for counts, limit in zip(results.get("per_step_counts", []), (2, 3), strict=False):
        overall = next(
            (
                r["commits_per_step"]
                for r in results.get("overhead", [])
                if r["agent"] == counts["agent"]
            ),
            None,
        )
        checks.append(
            _check(
                f"commits per step, {counts['agent'].split('.')[-1]} <= {limit}",
                counts["commits_per_step"],
                limit,
                counts["commits_per_step"] <= limit,
                f"per step in a run; {overall} with the claim and finish amortised over K",
            )
        )
    for row in results.get("overhead", []):
        if row["agent"] == agents.READ_AGENT:
            value = row["step_ms_p50"]
            checks.append(
                _check(
                    "engine overhead p50 <= 2 ms per step",
                    value,
                    2.0,
                    None if value is None else value <= 2.0,
                    f"DBOS {DBOS_REFERENCE['step_ms_p50']} ms",
                )
            )
    recovery = results.get("recovery")
    if recovery and "error" not in recovery:
        limit = recovery["lease_ttl_s"] + 2
        value = recovery.get("survivor_s_max")
        checks.append(
            _check(
                "recovery by the surviving worker <= lease TTL + 2 s",
                value,
                limit,
                None if value is None else value <= limit,
            )
        )
        value = recovery.get("cold_start_first_progress_s")
        checks.append(
            _check(
                "cold start to first progress <= 1 s",
                value,
                1.0,
                None if value is None else value <= 1.0,
                "DBOS 0.81 s",
            )
        )
    approval = results.get("approval")
    if approval and "error" not in approval:
        value = approval["ms_p50"]
        checks.append(
            _check(
                "approval -> dispatch p50 <= 300 ms",
                value,
                300,
                None if value is None else value <= 300,
            )
        )
    pages = results.get("pages", {}).get("pages", {})
    for label, limit in (("runs list", 100), ("run detail (1 run of N steps)", 200)):
        figures = pages.get(label)
        if figures and "ms_p95" in figures:
            checks.append(
                _check(
                    f"{label} p95 <= {limit} ms",
                    figures["ms_p95"],
                    limit,
                    figures["ms_p95"] <= limit,
                )
            )
    constant = [f.get("queries_constant") for f in pages.values() if "queries_constant" in f]
    if constant:
        checks.append(
            _check("page query counts constant in rows", all(constant), True, all(constant))
        )
    memory = results.get("memory")
    if memory and memory.get("growth_pct") is not None:
        checks.append(
            _check("worker RSS growth < 10%", memory["growth_pct"], 10, memory["growth_pct"] < 10)
        )
    checks += _flow_targets(results.get("flow"))
    sc = results.get("scale")
    if sc:
        t = sc["targets"]
        runs = sc.get("runs_in_table")
        checks += [
            _check(
                f"scale: pages p95 <= 150 ms ({runs} runs)",
                t["pages_p95_max_ms"],
                150,
                t["pages_ok"],
                "the slowest page or filter",
            ),
            _check(
                "scale: sweeper tick p95 <= 50 ms",
                sc["sweeper"]["ms_p95"],
                50,
                t["sweeper_ok"],
            ),
            _check(
                "scale: claim within 10 % of the small table's (p50)",
                sc["claim"]["ratio_p50"],
                1.10,
                t["claim_ok"],
            ),
            _check(
                "scale: no sequential scan of a growing table",
                ", ".join(t["sequential_scans"]) or "none",
                "none",
                t["plans_ok"],
            ),
        ]
    return checks


def _flow_targets(flow: dict | None) -> list[dict]:
    if not flow or "error" in flow:
        return []
    checks = []
    free = flow["not_binding"]
    ratio = free["ratio"]
    if ratio:
        checks.append(
            _check(
                f"flow: a limit that does not bind ({free['max_in_flight']} in flight) keeps "
                "steps/s within 10 % of no limit",
                ratio["median"],
                0.9,
                ratio["median"] >= 0.9,
                f"limited / unlimited, median of {free['rounds_measured']} interleaved "
                f"round(s), range {ratio['min']}-{ratio['max']}; statements per step "
                f"{free['unlimited']['queries_per_step']} -> {free['limited']['queries_per_step']}"
                f", commits {free['unlimited']['commits_per_step_exact']} -> "
                f"{free['limited']['commits_per_step_exact']}",
            )
        )
    bound = flow["binding"]
    seen, control = bound["limited"]["sandbox_max_in_flight"], bound["unlimited"]
    checks.append(
        _check(
            f"flow: with a binding limit the sandbox's maximum in flight equals the limit "
            f"({bound['max_in_flight']})",
            seen,
            bound["max_in_flight"],
            seen == bound["max_in_flight"],
            f"{control['sandbox_max_in_flight']} without the limit (same workers); "
            f"{bound['limited']['steps_per_s']} steps/s under it, "
            f"{control['steps_per_s']} without",
        )
    )
    return checks


def _ranged(spread: dict | None) -> str:
    if not spread:
        return "-"
    return f"{_f(spread['median'])} [{_f(spread['min'])}-{_f(spread['max'])}]"


def table(report: dict) -> str:
    results, meta = report["results"], report["meta"]
    lines = [
        "",
        f"agentops bench  {meta['date']}  {meta['host']}  {meta['cpus']} CPUs  "
        f"PostgreSQL {meta['postgresql']}  load {meta['load_average_start'][0]:.2f}"
        f"{'  (quick)' if meta['quick'] else ''}",
    ]
    if results.get("throughput"):
        rounds = results["throughput"][0].get("rounds_measured", 1)
        lines += [
            "",
            f"step throughput (W runs x K no-op tool steps, real workers; median of {rounds} "
            "interleaved round(s), the ratios' range in brackets)",
        ]
        lines.append(
            f"  {'tool':<11}{'workers':>8}{'x procs':>8}{'steps/s':>9}{'limit/s':>9}"
            f"{'ratio to limit':>22}{'DBOS/s':>8}{'ratio to DBOS':>22}"
            f"{'commits/step':>14}{'cpu ms/step':>13}"
        )
        for row in results["throughput"]:
            peer = (row.get("dbos") or {}).get("steps_per_s")
            lines.append(
                f"  {row['agent'].split('.')[-1]:<11}{row['workers']:>8}"
                f"{row.get('task_processes_per_worker', ''):>8}{_f(row['steps_per_s']):>9}"
                f"{_f(row['insert_commit_per_s']):>9}"
                f"{_ranged(row.get('ratio_to_limit_range')):>22}{_f(peer):>8}"
                f"{_ranged(row.get('ratio_to_dbos')):>22}"
                f"{_f(row['commits_per_step']):>14}{_f(row['worker_cpu_ms_per_step']):>13}"
            )
        samples = [
            (row["workers"], r)
            for row in results["throughput"]
            if row["agent"] == agents.READ_AGENT
            for r in row.get("rounds", [])
        ]
        if samples:
            lines.append(
                "  the machine in each round (1-min load at start -> end, CPU busy, steal):"
            )
            for workers, r in samples:
                lines.append(
                    f"    {workers} worker(s), round {r['round']}: load {r.get('load_start')} -> "
                    f"{r.get('load_end')}, busy {r.get('cpu_busy_pct')} %, steal "
                    f"{r.get('steal_pct')} %"
                )
    if results.get("overhead"):
        lines += ["", "engine overhead per step (sequential, in process)"]
        counts = {c["agent"]: c for c in results.get("per_step_counts", [])}
        for row in results["overhead"]:
            c = counts.get(row["agent"], {})
            lines.append(
                f"  {row['agent'].split('.')[-1]:<11} p50 {_f(row['step_ms_p50'])} ms  "
                f"p95 {_f(row['step_ms_p95'])} ms  cpu p50 {_f(row['step_cpu_ms_p50'])} ms  "
                f"postgres cpu {_f(row['postgres_cpu_ms_per_step'])} ms  "
                f"per step: {c.get('queries_per_step')} queries, {c.get('commits_per_step')} "
                f"commits (+{c.get('commits_per_run_besides_steps')} per run)"
            )
    for name in ("recovery", "approval", "memory"):
        if "error" in results.get(name, {}):
            lines += ["", f"{name}: FAILED: {results[name]['error']}"]
    if results.get("recovery") and "error" not in results["recovery"]:
        r = results["recovery"]
        lines += [
            "",
            f"recovery (lease TTL {r['lease_ttl_s']} s, {r['runs_held']} runs held): survivor "
            f"{r.get('survivor_s')} s; cold start first progress "
            f"{_f(r.get('cold_start_first_progress_s'))} s, all {_f(r.get('cold_start_all_progress_s'))} s",
        ]
    if results.get("approval") and "error" not in results["approval"]:
        a = results["approval"]
        lines += [
            "",
            f"approval -> dispatch: p50 {_f(a['ms_p50'])} ms, p95 {_f(a['ms_p95'])} ms "
            f"({a['dispatched']}/{a['approvals']})",
        ]
    if results.get("memory") and "error" not in results["memory"]:
        m = results["memory"]
        samples = ", ".join(
            f"{key} steps {value['rss_mb_group']} MB" for key, value in m["samples"].items()
        )
        lines += ["", f"worker RSS (process group): {samples}; growth {_f(m['growth_pct'])}%"]
    if results.get("pages"):
        p = results["pages"]
        lines += [
            "",
            f"pages ({p['runs_in_table']} runs, a run of {p['big_run_steps']} steps; "
            "server time in process)",
        ]
        http = results.get("http", {})
        for label, f in p["pages"].items():
            if "error" in f:
                lines.append(f"  {label:<32} {f['error']}")
                continue
            rps = http.get(label, {}).get("requests_per_s")
            lines.append(
                f"  {label:<32} p50 {_f(f['ms_p50']):>7} ms  p95 {_f(f['ms_p95']):>7} ms  "
                f"{f['queries']:>3} queries ({f.get('queries_with_few_rows')} with few rows)"
                + (f"  {rps} req/s (gunicorn)" if rps is not None else "")
            )
    lines += _flow_table(results.get("flow"))
    sc = results.get("scale")
    if sc:
        fill = sc["fill"]
        lines += [
            "",
            f"scale ({sc['runs_in_table']} runs, ~{sc['events_in_table']} events; filled in "
            f"{fill['total_s']} s: chain {fill['chain_s']} s, runs {fill['runs_s']} s, events "
            f"{fill['events_s']} s, analyze {fill['analyze_s']} s)",
            f"  claim p50 {sc['claim']['small_table']['ms_p50']} ms on a small table, "
            f"{sc['claim']['large_table']['ms_p50']} ms here (x{sc['claim']['ratio_p50']})",
        ]
        for label, f in {"sweeper tick": sc["sweeper"], **sc["pages"]}.items():
            if "error" in f:
                lines.append(f"  {label:<36} {f['error']}")
                continue
            scans = ", ".join(f["seq_scans"])
            lines.append(
                f"  {label:<36} p50 {_f(f['ms_p50']):>7} ms  p95 {_f(f['ms_p95']):>7} ms  "
                f"{f['queries']:>3} queries" + (f"  SEQ SCAN {scans}" if scans else "")
            )
        prune = sc["prune"]
        lines.append(
            f"  audit_verify --run (big run) {sc['audit_verify_one_run_s']} s; incremental "
            f"audit_verify (everything) {sc.get('audit_verify_incremental_s')} s; prune: "
            f"candidates {prune['candidates_ms']} ms, {prune['per_run_ms']} ms per run "
            f"(batch of {prune['batch']})"
        )
    if report["targets"]:
        lines += ["", "targets"]
        for check in report["targets"]:
            verdict = {True: "holds", False: "MISSED", None: "n/a"}[check["holds"]]
            lines.append(
                f"  {verdict:<7} {check['target']}: {check['value']} (limit {check['limit']})"
                + (f"  [{check['note']}]" if check["note"] else "")
            )
    return "\n".join(lines)


def _flow_table(flow: dict | None) -> list[str]:
    if not flow:
        return []
    if "error" in flow:
        return ["", f"flow: FAILED: {flow['error']}"]
    free, bound = flow["not_binding"], flow["binding"]
    lines = [
        "",
        f"flow control: a limit of {free['max_in_flight']} in flight that does not bind "
        f"({free['runs']} runs x {free['steps_per_run']} idempotent no-op steps, "
        f"{free['workers']} workers; median of {free['rounds_measured']} interleaved round(s))",
    ]
    for side in ("unlimited", "limited"):
        f = free[side]
        lines.append(
            f"  {side:<10} {_f(f['steps_per_s']):>7} steps/s  {_f(f['commits_per_step'])} "
            f"commits/step (all the workers' transactions)  cpu {_f(f['worker_cpu_ms_per_step'])}"
            f" ms/step  one step: {f['queries_per_step']} statements, "
            f"{f['commits_per_step_exact']} commits"
        )
    lines.append(f"  limited / unlimited: {_ranged(free['ratio'])}")
    lines.append(
        f"flow control: a binding limit of {bound['max_in_flight']} in flight ({bound['runs']} "
        f"runs x {bound['steps_per_run']} sandbox refunds of {bound['latency_ms']} ms, "
        f"{bound['workers']} workers x {bound['task_processes_per_worker']} task processes)"
    )
    for side in ("unlimited", "limited"):
        f = bound[side]
        lines.append(
            f"  {side:<10} sandbox max in flight {f['sandbox_max_in_flight']}  "
            f"{_f(f['steps_per_s'])} steps/s ({_f(f['sandbox_requests_per_s'])} refunds/s at "
            f"the sandbox)  {f['succeeded']}/{bound['runs']} succeeded  "
            f"{f['waits_for_capacity']} waits for capacity"
        )
    return lines


def _f(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.2f}" if value < 10 else f"{value:.1f}" if value < 1000 else f"{value:.0f}"
    return str(value)

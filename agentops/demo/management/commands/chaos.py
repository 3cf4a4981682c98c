"""``python manage.py chaos``: the crash harness (issue 2, item 9).

It starts the sandbox payments service in its NON-deduplicating mode (only the engine's
discipline prevents a double refund there) and real ``runworker`` processes against the
configured database, creates demo refund runs, decides their approvals like a person would,
and SIGKILLs worker process groups: once at every checkpoint boundary (a worker restarted
with ``AGENTOPS_CRASH_AT=<boundary>`` kills its own group right after that commit), then at
random moments. Killed workers are restarted without the variable. When every run is
terminal it checks the invariants against the sandbox's refund table and the record, and
prints one JSON object as its last line. Exit status 1 when an invariant fails.

A kill counts in ``boundaries_killed`` only when it is proven: the worker died of SIGKILL
(return code -9) at that boundary, and a run it held then shows a ``run.claimed`` event with
``recovered: true``.

With ``--pauses N`` (DESIGN §9) it then freezes workers instead of killing them, in one
round per sandbox mode (``--sandbox-modes``: the sandbox deduplicating by key; checking send
deadlines; honouring nothing; honouring nothing with the refund tool's ``resend: person``),
the workers started with the matching declaration (``AGENTOPS_SANDBOX_HONOURS``,
``AGENTOPS_SANDBOX_RESEND``). Each round pauses N times: at ``before_send`` and
``dispatching`` first, then alternately at a random moment (SIGSTOP of a worker's process
group) and at the next boundary in turn (a worker started with ``AGENTOPS_PAUSE_AT`` freezes
its own group there). A pause lasts longer than the lease TTL + the landing window, so
another worker takes the run over and, where it must, sends again; then the frozen worker
is resumed (SIGCONT) and runs on: each write of it the fence refuses is a
``zombie_writes_refused`` (its "stopping this incarnation" log lines, i.e. ``run.lease_lost``).
``late_sends`` counts the requests the sandbox received after their send deadline.

Notifications (DESIGN §9): the workers send email to a real SMTP server the harness starts
(aiosmtpd), and the approver decides each approval only through the link in the email it
received — opened (GET) and submitted (POST) like a person signed in would. The kills and
pauses include the outbox's points (``notify_enqueued``, ``notify_claimed``,
``notify_sent``; each on a fresh run that needs an approval). ``lost_notifications``: the
approvals whose approver received no email with a working link within
``NOTIFY_GRACE_SECONDS`` of the approval appearing and of the latest worker start (then
decided directly, so the run can end) or never;
``duplicate_notifications``: copies of a Message-ID received more than once, allowed only
after a kill or a pause between a send and its mark: at most one per kill or pause
(``duplicate_notifications_allowed``).
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import tempfile
import time
from collections import Counter, deque
from contextlib import suppress
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any
from urllib.parse import quote

import httpx
from django.conf import settings
from django.core.management.base import BaseCommand, CommandError
from django.db import DatabaseError, connection, transaction

from agentops import workerprocs
from runs.faults import BOUNDARIES
from runs.record.eventtypes import EventType

# Worker settings for a harness that kills every few seconds: short leases and polls so a
# recovery takes seconds. MAX_RECOVERIES is raised because chaos recovers the same run far
# more often than production ever should; the limit itself is tested elsewhere.
WORKER_DEFAULTS = {
    "AGENTOPS_LEASE_TTL": "3",
    "AGENTOPS_SWEEP_INTERVAL": "0.2",
    "AGENTOPS_REQUEUE_AFTER": "1.5",
    "AGENTOPS_RECONCILE_BACKOFF": "0.2",
    "AGENTOPS_REDISPATCH_MARGIN": "0.5",
    "AGENTOPS_WORKER_STALE_AFTER": "3",
    "AGENTOPS_CANARY_INTERVAL": "1",
    "AGENTOPS_FROZEN_AFTER": "10",
    "AGENTOPS_Q_POLL": "0.05",
    "AGENTOPS_Q_TIMEOUT": "60",
    "AGENTOPS_Q_RETRY": "90",
    "AGENTOPS_Q_WORKERS": "4",
    "AGENTOPS_SLICE_SECONDS": "20",
    "AGENTOPS_MAX_RECOVERIES": "1000",
    # short send window and tool timeout: a pause must outlast TTL + the landing window
    "AGENTOPS_SEND_WINDOW": "1",
    "AGENTOPS_SANDBOX_TIMEOUT": "2",
    # the outbox: a claim a pause outlasts, and quick retries
    "AGENTOPS_OUTBOX_CLAIM_SECONDS": "5",
    "AGENTOPS_OUTBOX_SEND_TIMEOUT": "1",
    "AGENTOPS_OUTBOX_BACKOFF": "0.5",
    "LOG_LEVEL": "WARNING",
}

# The order of the boundary kills (the outbox's last). After approval_requested and
# run_finished (and a decided that shares their commit) the dying run holds no lease, so
# those kills are proven through ANOTHER run the worker held: such a crash worker runs
# several task processes and goes while many runs are in flight. The others run one task
# process, so each kill uses up as little of the runs' remaining work as possible, and
# follow a run's life.
KILL_ORDER = (
    "approval_requested",
    "claimed",
    "decided",
    "dispatching",
    "before_send",
    "tool_call",
    "receipt_recorded",
    "step_completed",
    "run_finished",
    # last: each brings a fresh run that needs an approval, and needs no other run in flight
    "notify_enqueued",
    "notify_claimed",
    "notify_sent",
)
NEEDS_COMPANY = ("approval_requested", "decided", "run_finished")
# the outbox's points: proven by the kill itself (the worker said it died there) and by the
# approver then receiving the email; each is tried on a fresh run that needs an approval
NOTIFY_BOUNDARIES = ("notify_enqueued", "notify_claimed", "notify_sent")
# an approver who has no email this long after the approval appeared counts it as lost
NOTIFY_GRACE_SECONDS = 30.0
assert sorted(KILL_ORDER) == sorted(BOUNDARIES)

# --pauses: each round's first pauses, then (alternating with random ones) the others in
# turn, continued from round to round
PAUSE_FIRST = ("before_send", "dispatching")
PAUSE_CYCLE = (
    "tool_call",
    # a drainer frozen after claiming an email: the pre-send check must stop it
    "notify_claimed",
    "claimed",
    "decided",
    "receipt_recorded",
    "step_completed",
    "approval_requested",
    "run_finished",
    "notify_enqueued",
    "notify_sent",
)
assert sorted(PAUSE_FIRST + PAUSE_CYCLE) == sorted(BOUNDARIES)
# boundary -> (AGENTOPS_PAUSE_AT, a large refund?) for a fresh run that the pausing worker
# advances alone: ":2" picks the refund's step (the lookup is the first), and a large refund
# also passes the approval gate (as tests/runs/test_crash.py)
PAUSE_SPECS = {
    "claimed": ("claimed", False),
    "decided": ("decided:2", False),
    "approval_requested": ("approval_requested", True),
    "dispatching": ("dispatching:2", True),
    "before_send": ("before_send", False),
    "tool_call": ("tool_call:2", True),
    "receipt_recorded": ("receipt_recorded:2", False),
    "step_completed": ("step_completed:2", False),
    "run_finished": ("run_finished", False),
    "notify_enqueued": ("notify_enqueued", True),
    "notify_claimed": ("notify_claimed", True),
    "notify_sent": ("notify_sent", True),
}
assert sorted(PAUSE_SPECS) == sorted(BOUNDARIES)
# what the sandbox honours in each pause round: its switches, and the workers' declaration
SANDBOX_MODES: dict[str, dict[str, Any]] = {
    "key": {"dedupe": True, "deadline": False, "honours": "key", "resend": "auto"},
    "deadline": {"dedupe": False, "deadline": True, "honours": "deadline", "resend": "auto"},
    "nothing": {"dedupe": False, "deadline": False, "honours": "", "resend": "auto"},
    "person": {"dedupe": False, "deadline": False, "honours": "", "resend": "person"},
}
KILL_ROUND = "kills"  # the kill round's sandbox honours nothing, as "nothing"
# a resumed worker's log line for each write the fence refused (runs/engine/loop.py)
LEASE_LOST_LINE = "stopping this incarnation"
# after SIGCONT, a frozen worker runs on this long at most before it is stopped
RUN_ON_SECONDS = 4.0

APPROVER_USERNAME = "chaos-approver"
APPROVER_EMAIL = "chaos-approver@chaos.invalid"
WORKER_APP = "agentops-chaos-worker"
# --db-faults: a round of pg_terminate_backend every this many seconds (uniform), and for
# this long into the drain, so runs still finish once the faults stop
DB_FAULT_INTERVAL = (0.5, 2.5)
DB_FAULT_DRAIN_SECONDS = 15.0
REFUND_THRESHOLD_CENTS = 10_000  # agentops.demo.tools.REFUND_APPROVAL_THRESHOLD_CENTS
# refunds take this long in the sandbox, so that kills land while calls are in flight
REFUND_LATENCY_MS = 300
# one attempt to reach a boundary; a reconciliation may park a run for tool timeout + margin
ATTEMPT_SECONDS = 20.0
ATTEMPTS_PER_BOUNDARY = 4
POLL = 0.02


class _Interrupted(BaseException):
    """SIGINT or SIGTERM: stop everything, clean up, report."""


@dataclass
class WorkerProcess:
    slot: int
    name: str
    crash_at: str | None
    process: subprocess.Popen[bytes]
    log_path: Path

    @property
    def alive(self) -> bool:
        return self.process.poll() is None

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def log_tail(self, lines: int = 8) -> str:
        return "\n".join(self.log().splitlines()[-lines:])


@dataclass
class Kill:
    worker: str
    boundary: str | None  # None: a kill at a random moment
    at: datetime
    returncode: int | None
    affected: list[Any]
    recovered_after: dict[str, float] = field(default_factory=dict)

    @property
    def sigkilled(self) -> bool:
        return self.returncode == -signal.SIGKILL

    @property
    def proven(self) -> bool:
        if self.boundary in NOTIFY_BOUNDARIES:
            # the run it was emailing about holds no lease: the email is the proof
            # (lost_notifications)
            return self.sigkilled
        return self.sigkilled and bool(self.recovered_after)


@dataclass
class Pause:
    worker: str
    boundary: str | None  # None: a pause at a random moment
    mode: str
    at: datetime
    affected: list[Any]
    seconds: float = 0.0
    refused: int = 0  # the resumed worker's writes the fence refused


@dataclass
class Options:
    runs: int
    random_kills: int
    boundaries: list[str]
    workers: int
    timeout: float
    seed: int
    db_faults: bool = False
    pg_restart_cmd: str = ""
    pauses: int = 0
    sandbox_modes: list[str] = field(default_factory=lambda: list(SANDBOX_MODES))
    # flow control (issue 26): a limit on the demo refund tool for the whole harness
    tool_concurrency: int | None = None
    tool_rate: float | None = None


def parse_sandbox_modes(value: str) -> list[str]:
    names = [name.strip() for name in value.split(",") if name.strip()]
    unknown = [name for name in names if name not in SANDBOX_MODES]
    if not names or unknown:
        raise CommandError(
            f"--sandbox-modes: expected a comma-separated list of {', '.join(SANDBOX_MODES)}"
            + (f", not {unknown[0]!r}" if unknown else "")
        )
    return list(dict.fromkeys(names))


def parse_boundaries(value: str) -> list[str]:
    value = value.strip()
    if value == "all":
        return list(BOUNDARIES)
    if value == "none":
        return []
    names = [name.strip() for name in value.split(",") if name.strip()]
    if not names:
        raise CommandError("--boundaries: expected 'all', 'none' or a comma-separated list")
    unknown = [name for name in names if name not in BOUNDARIES]
    if unknown:
        raise CommandError(
            f"--boundaries: unknown boundary {unknown[0]!r} "
            f"(expected all, none or some of: {', '.join(BOUNDARIES)})"
        )
    return list(dict.fromkeys(names))


def database_url() -> str:
    """The URL of the database this process uses, for the worker subprocesses. Built from
    the live connection settings, so under pytest it names the test database."""
    db = connection.settings_dict
    engine = db["ENGINE"]
    if engine == "django.db.backends.sqlite3":
        name = str(db["NAME"])
        if name == ":memory:" or name.startswith("file:") or "mode=memory" in name:
            raise CommandError(
                "chaos needs a database file or server: worker processes cannot share "
                "an in-memory SQLite database"
            )
        return "sqlite:///" + str(Path(name).resolve())
    if engine == "django.db.backends.postgresql":
        env_url = os.environ.get("DATABASE_URL", "")
        if env_url:
            import dj_database_url

            with suppress(Exception):
                parsed = dj_database_url.parse(env_url)
                if parsed.get("NAME") == db["NAME"]:
                    return env_url  # keeps any query options (sslmode, ...)
        auth = quote(str(db.get("USER") or ""), safe="")
        if db.get("PASSWORD"):
            auth += ":" + quote(str(db["PASSWORD"]), safe="")
        host = str(db.get("HOST") or "")
        port = f":{db['PORT']}" if db.get("PORT") else ""
        return f"postgres://{auth}{'@' if auth else ''}{host}{port}/{quote(str(db['NAME']))}"
    raise CommandError(f"chaos does not support the database engine {engine}")


def plan_refunds(count: int, rng: random.Random) -> list[dict[str, Any]]:
    """``count`` refund inputs over the sandbox's seeded orders: every third one above the
    approval threshold (the first among them, so even one run passes every boundary), and
    never more per order than the order can refund across all runs."""
    from agentops.demo.sandbox import SEED_ORDERS

    orders = [order_id for order_id, _, _ in SEED_ORDERS]
    remaining = {order_id: amount for order_id, _, amount in SEED_ORDERS}
    plans: list[dict[str, Any]] = []
    for index in range(count):
        amount = 0
        large = index % 3 == 0
        if large:
            order_id = max(orders, key=lambda o: remaining[o])
            amount = REFUND_THRESHOLD_CENTS + 1 + rng.randrange(2_000)
            if amount > remaining[order_id]:
                large, amount = False, 0
        if not large:
            order_id = orders[index % len(orders)]
            amount = min(100 + rng.randrange(900), remaining[order_id] // 4)
            if amount < 1:
                order_id = max(orders, key=lambda o: remaining[o])
                amount = min(100, remaining[order_id])
        if amount < 1:
            raise CommandError(f"--runs {count}: the sandbox's orders cannot fund so many refunds")
        remaining[order_id] -= amount
        kind = "large" if large else "small"
        plans.append(
            {
                "order_id": order_id,
                "amount_cents": amount,
                "reason": f"chaos {kind} refund {index + 1}",
            }
        )
    return plans


class Command(BaseCommand):
    help = (
        "Crash harness: real workers SIGKILLed at every checkpoint boundary and at random "
        "moments, and (--pauses) frozen past their lease and resumed, against the sandbox in "
        "each mode; checks that no refund happened twice, no run was lost and no approval was "
        "used twice. Prints a JSON summary as its last line; exit status 1 on a violation."
    )

    def add_arguments(self, parser):
        parser.add_argument("--runs", type=int, default=20, help="demo refund runs (default 20)")
        parser.add_argument(
            "--random-kills", type=int, default=10, help="kills at random moments (default 10)"
        )
        parser.add_argument(
            "--boundaries",
            default="all",
            help=f"all, none, or a comma-separated list of: {', '.join(BOUNDARIES)}",
        )
        parser.add_argument("--workers", type=int, default=2, help="worker processes (default 2)")
        parser.add_argument(
            "--pauses",
            type=int,
            default=0,
            help="per sandbox mode: freeze a worker (SIGSTOP) this many times for longer than "
            "lease TTL + landing window, then resume it (default 0)",
        )
        parser.add_argument(
            "--sandbox-modes",
            default=",".join(SANDBOX_MODES),
            help="with --pauses: the rounds, a comma-separated list of "
            f"{', '.join(SANDBOX_MODES)} (default: all)",
        )
        parser.add_argument(
            "--tool-concurrency",
            type=int,
            default=None,
            metavar="N",
            help="limit the refund tool to N calls in flight across all workers (an operator's "
            "limit, docs/agents.md); the sandbox's own maximum in flight must stay <= N",
        )
        parser.add_argument(
            "--tool-rate",
            type=float,
            default=None,
            metavar="R",
            help="limit the refund tool to R calls per second (burst 1)",
        )
        parser.add_argument(
            "--timeout", type=float, default=900.0, help="give up after this many seconds"
        )
        parser.add_argument("--seed", type=int, default=None, help="random seed (default: random)")
        parser.add_argument(
            "--db-faults",
            action="store_true",
            help="PostgreSQL only: also terminate the workers' database connections "
            "(pg_terminate_backend) every few seconds while runs are in flight",
        )
        parser.add_argument(
            "--pg-restart-cmd",
            default="",
            metavar="CMD",
            help="with --db-faults: a shell command that restarts PostgreSQL, run once "
            "mid-way (e.g. 'sudo pg_ctlcluster 15 main restart'); never in CI",
        )

    def handle(self, *args, **options):
        self.verbosity = options["verbosity"]
        opts = self._options(options)
        self._check_database()
        harness = Harness(opts, out=self._progress)
        previous = {
            sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
        }

        def interrupt(signum, frame):
            raise _Interrupted(signal.Signals(signum).name)

        for sig in previous:
            signal.signal(sig, interrupt)
        interrupted = error = ""
        report: dict[str, Any] = {}
        problems: list[str] = []
        try:
            try:
                harness.run()
                report, problems = harness.report()
            except _Interrupted as exc:
                interrupted = str(exc) or "interrupted"
            except (DatabaseError, httpx.HTTPError, OSError, RuntimeError) as exc:
                harness.keep_logs = True
                error = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
            finally:
                # a second Ctrl-C must not cut the clean-up short
                for sig in previous:
                    signal.signal(sig, signal.SIG_IGN)
                harness.cleanup()
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
        if interrupted:
            raise CommandError(
                f"chaos: {interrupted}: stopped the sandbox and all workers", returncode=130
            )
        if error:
            raise CommandError(f"chaos: {error} (worker logs in {harness.tmp})")
        self.stdout.write(json.dumps(report))
        self.stdout.flush()
        if problems:
            raise CommandError("chaos: " + "; ".join(problems), returncode=1)

    def _progress(self, message: str, level: int = 1) -> None:
        if self.verbosity >= level:
            self.stdout.write(f"chaos: {message}")
            self.stdout.flush()

    def _options(self, options) -> Options:
        runs, kills, workers = options["runs"], options["random_kills"], options["workers"]
        timeout = options["timeout"]
        if not 1 <= runs <= 500:
            raise CommandError(f"--runs must be between 1 and 500, not {runs}")
        if not 0 <= kills <= 1000:
            raise CommandError(f"--random-kills must be between 0 and 1000, not {kills}")
        if not 1 <= workers <= 16:
            raise CommandError(f"--workers must be between 1 and 16, not {workers}")
        if not timeout > 0:
            raise CommandError(f"--timeout must be a positive number of seconds, not {timeout}")
        pauses = options["pauses"]
        if not 0 <= pauses <= 100:
            raise CommandError(f"--pauses must be between 0 and 100, not {pauses}")
        concurrency, rate = options["tool_concurrency"], options["tool_rate"]
        if concurrency is not None and not 1 <= concurrency <= 1000:
            raise CommandError(f"--tool-concurrency must be between 1 and 1000, not {concurrency}")
        if rate is not None and not 0.01 <= rate <= 10_000:
            raise CommandError(f"--tool-rate must be between 0.01 and 10000, not {rate}")
        seed = options["seed"] if options["seed"] is not None else random.randrange(1 << 30)
        db_faults, pg_restart_cmd = options["db_faults"], options["pg_restart_cmd"].strip()
        if pg_restart_cmd and not db_faults:
            raise CommandError("--pg-restart-cmd needs --db-faults")
        if db_faults and connection.vendor != "postgresql":
            raise CommandError(
                f"--db-faults needs PostgreSQL (pg_terminate_backend), not {connection.vendor}"
            )
        if db_faults and settings.PG_POOLER == "transaction":
            # the workers' backends are found by application name, which a pooled backend
            # carries for whichever client used it last: the harness would cut its own
            raise CommandError(
                "--db-faults cannot tell the workers' backends behind a transaction pooler"
            )
        return Options(
            runs=runs,
            random_kills=kills,
            boundaries=parse_boundaries(options["boundaries"]),
            workers=workers,
            timeout=timeout,
            seed=seed,
            db_faults=db_faults,
            pg_restart_cmd=pg_restart_cmd,
            pauses=pauses,
            sandbox_modes=parse_sandbox_modes(options["sandbox_modes"]),
            tool_concurrency=concurrency,
            tool_rate=rate,
        )

    def _check_database(self) -> None:
        from runs.models import Run, Worker
        from runs.workers import _pid_alive

        try:
            Run.objects.exists()
            others = list(
                Worker.objects.exclude(health=Worker.Health.STOPPED).values_list(
                    "name", "host", "pid", "heartbeat_at"
                )
            )
            from runs.dbtime import db_now

            now = db_now()
        except DatabaseError as exc:
            first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
            raise CommandError(
                f"cannot use the database ({first}); is it reachable and migrated "
                "(python manage.py migrate)?"
            ) from None
        import socket

        stale = settings.AGENTOPS["WORKER_STALE_AFTER"]
        alive = [
            name
            for name, host, pid, heartbeat in others
            if (now - heartbeat).total_seconds() < stale
            and (host != socket.gethostname() or _pid_alive(pid))
        ]
        if alive:
            raise CommandError(
                f"other workers are running against this database ({', '.join(sorted(alive))}): "
                "they would advance chaos runs without the sandbox; stop them or point "
                "DATABASE_URL at another database"
            )


class Harness:
    def __init__(self, opts: Options, *, out) -> None:
        self.opts = opts
        self.out = out
        self.rng = random.Random(opts.seed)
        self.started = time.monotonic()
        self.deadline = self.started + opts.timeout
        self.tag = f"chaos-{os.urandom(3).hex()}"  # unique per invocation, whatever the seed
        self.tmp = Path(tempfile.mkdtemp(prefix="agentops-chaos-"))
        self.sandbox = None
        self.workers: dict[int, WorkerProcess] = {}
        self.incarnations: Counter[int] = Counter()
        self.run_ids: list[Any] = []
        self.kills: list[Kill] = []
        self.approval_seen: dict[Any, float] = {}
        self.approver = None
        self.timed_out = False
        self.unreached: list[str] = []
        self.notes: list[str] = []
        self.keep_logs = False
        self.refunds: list[dict[str, Any]] = []
        # database faults: connections terminated, PostgreSQL restarts, when the next is due
        self.db_faults_until = 0.0
        self.next_db_fault = 0.0
        self.connections_terminated = 0
        self.pg_restarts = 0
        self.workers_restarted = 0  # ordinary workers that exited on their own: a failure
        self.pg_restart_due = False
        # rounds (DESIGN §9): the sandbox mode each run was made in, and what each round's
        # sandbox received after its send deadline
        self.mode = KILL_ROUND
        self.run_mode: dict[str, str] = {}
        self.late_requests: list[dict[str, Any]] = []
        self.limited = False
        self.max_in_flight_calls = 0
        self.peak_requests_per_second = 0
        self.pauses: list[Pause] = []
        self.pausers: list[WorkerProcess] = []  # frozen and resumed workers, never restarted
        self.pause_cycle = 0
        self.unpaused: list[str] = []
        self.remaining_cents: dict[str, int] = {}
        self.plans: list[dict[str, Any]] = []
        self.held_back = 0
        # notifications: the SMTP sink, when each approval was first seen pending, which
        # ones the approver had to decide without an email, links that did not work
        self.sink: Any = None
        self.approval_due: dict[str, float] = {}
        self.unnotified: set[str] = set()
        self.broken_links: list[str] = []
        self.scanner_decisions: list[str] = []
        # when a worker was last started (monotonic, wall): "alive again" for the grace
        self.last_start = 0.0
        self.starts: list[datetime] = []

    # --- setup ------------------------------------------------------------------------------

    def run(self) -> None:
        from agentops.demo.sandbox import start_sandbox

        opts = self.opts
        self.db_url = database_url()
        self.sandbox = start_sandbox(str(self.tmp / "sandbox.sqlite3"), mode="nodedupe")
        self.out(
            f"seed {opts.seed}; sandbox (nodedupe) at {self.sandbox.url}; database "
            f"{connection.vendor}; {opts.workers} workers; logs in {self.tmp}"
        )
        self.approver = self._approver()
        self._limit_refunds()
        self._start_sink()
        try:
            if opts.random_kills or opts.boundaries or not opts.pauses:
                self._begin_round(KILL_ROUND)
                self._plan_runs()
                self._boundary_phase()
                self._random_phase()
                self._drain()
                self._end_round()
            if opts.pauses:
                self.out(f"pauses of {self.pause_seconds():.1f}s (lease TTL + landing window + 1s)")
                for mode in opts.sandbox_modes:
                    self._begin_round(mode)
                    self._pause_phase()
                    self._drain()
                    self._end_round()
        except _Timeout:
            self.timed_out = True
            self.notes.append(f"timed out after {self.opts.timeout:.0f}s")
            self._end_round()

    # --- rounds: one sandbox mode each --------------------------------------------------------

    def _begin_round(self, mode: str) -> None:
        """A fresh sandbox ledger in the round's mode, and workers that declare it."""
        self.mode = mode
        switches = SANDBOX_MODES.get(mode, SANDBOX_MODES["nothing"])
        self._sandbox("POST", "/reset")
        self._sandbox(
            "POST", "/mode", json={"dedupe": switches["dedupe"], "deadline": switches["deadline"]}
        )
        self._sandbox("POST", "/faults", json={"latency_ms": REFUND_LATENCY_MS})
        from agentops.demo.sandbox import SEED_ORDERS

        self.remaining_cents = {order_id: amount for order_id, _, amount in SEED_ORDERS}
        self.out(
            f"round {mode}: sandbox {switches['dedupe'] and 'dedupe' or 'nodedupe'}, "
            f"deadline {'on' if switches['deadline'] else 'off'}; tools declare honours "
            f"{switches['honours'] or 'nothing'}, resend {switches['resend']}"
        )

    def _end_round(self) -> None:
        """Every worker stopped first (a resumed one must not send into the next round);
        then the sandbox's own record of what really happened in this round."""
        for worker in list(self.workers.values()) + self.pausers:
            self._stop(worker)
        self.workers.clear()
        self.refunds.extend(self._sandbox("GET", "/refunds/all")["refunds"])
        late = self._sandbox("GET", "/requests", params={"late": "1"})["requests"]
        self.late_requests.extend({**request, "mode": self.mode} for request in late)
        # the downstream's own view of the load (issue 26), before the next round resets it
        summary = self._sandbox("GET", "/requests/summary")
        self.max_in_flight_calls = max(
            self.max_in_flight_calls, summary["max_in_flight_by_path"].get("/refunds", 0)
        )
        self.peak_requests_per_second = max(
            self.peak_requests_per_second, summary["peak_requests_per_second"]
        )

    def _limit_refunds(self) -> None:
        """``--tool-concurrency`` / ``--tool-rate``: an operator's limit on the refund tool,
        read by every worker at its claims (runs.flow); removed again at the clean-up."""
        self.max_in_flight_calls = 0
        self.peak_requests_per_second = 0
        opts = self.opts
        if opts.tool_concurrency is None and opts.tool_rate is None:
            return
        from runs import flow
        from runs.actors import Actor

        flow.tool_limit_set(
            tool_name="refund_payment",
            actor=Actor.system("cli"),
            max_in_flight=opts.tool_concurrency,
            rate=opts.tool_rate,
            reason="manage.py chaos",
        )
        self.limited = True
        self.out(
            f"refund_payment limited: {opts.tool_concurrency} in flight, rate {opts.tool_rate}"
        )

    def _sandbox(self, method: str, path: str, **kwargs) -> Any:
        response = httpx.request(method, self.sandbox.url + path, timeout=10, **kwargs)
        response.raise_for_status()
        return response.json()

    def _start_sink(self) -> None:
        from agentops.demo.smtpsink import SmtpSink

        try:
            import aiosmtpd  # noqa: F401 -- a development dependency
        except ImportError:
            self.notes.append(
                "aiosmtpd is not installed: emails not checked (pip install -e .[dev])"
            )
            return
        self.sink = SmtpSink()
        port = self.sink.start()
        self.out(f"SMTP sink at 127.0.0.1:{port}; the approver decides through emailed links")

    def _approver(self):
        from django.contrib.auth import get_user_model
        from django.contrib.auth.models import Group, Permission

        from approvals.roles import ROLE_PERMISSIONS

        with transaction.atomic():
            group, _ = Group.objects.get_or_create(name="approver")
            for perm in ROLE_PERMISSIONS["approver"]:
                app_label, codename = perm.split(".")
                group.permissions.add(
                    Permission.objects.get(content_type__app_label=app_label, codename=codename)
                )
            user, created = get_user_model().objects.get_or_create(
                username=APPROVER_USERNAME,
                defaults={"is_active": True, "email": APPROVER_EMAIL},
            )
            if user.email != APPROVER_EMAIL:
                user.email = APPROVER_EMAIL
                user.save(update_fields=["email"])
            if created:
                user.set_unusable_password()
                user.save(update_fields=["password"])
            user.groups.add(group)
        return get_user_model().objects.get(pk=user.pk)  # fresh permission cache

    def _plan_runs(self) -> None:
        """All runs are planned now; a third of them (beyond the six the boundary kills need)
        is held back and started during the random kills, so those land on work in flight."""
        opts = self.opts
        self.plans = plan_refunds(opts.runs, self.rng)
        for plan in self.plans:  # what the extra runs (notify kills) may still refund
            self.remaining_cents[plan["order_id"]] -= plan["amount_cents"]
        held_back = 0
        if opts.random_kills:
            held_back = opts.runs // 2
            if opts.boundaries:
                held_back = min(opts.runs // 3, max(0, opts.runs - 6))
        large = sum(1 for plan in self.plans if plan["amount_cents"] > REFUND_THRESHOLD_CENTS)
        self.out(
            f"{opts.runs} refund runs ({large} need an approval); "
            f"{held_back} start during the random kills"
        )
        self.held_back = held_back
        self._create_runs(opts.runs - held_back)

    def _create_runs(self, count: int) -> None:
        start = len([run_id for run_id in self.run_ids if self.run_mode[str(run_id)] == KILL_ROUND])
        for index in range(start, min(start + count, len(self.plans))):
            self._create_run(self.plans[index], f"refund {index + 1}")

    def _create_run(self, plan: dict[str, Any], label: str) -> Any:
        from runs.actors import Actor
        from runs.services import run_create

        run = run_create(
            agent_name="refund",
            goal=f"{self.tag} {self.mode} {label}: {plan['order_id']}",
            input=plan,
            actor=Actor.system("cli"),
        )
        self.run_ids.append(run.id)
        self.run_mode[str(run.id)] = self.mode
        return run.id

    def _pause_plan(self, *, large: bool) -> dict[str, Any]:
        """One refund the round's orders can still fund: large ones need an approval."""
        remaining = self.remaining_cents
        order_id = max(remaining, key=lambda o: remaining[o])
        if large:
            amount = REFUND_THRESHOLD_CENTS + 1 + self.rng.randrange(2_000)
        else:
            order_id = self.rng.choice(sorted(remaining, key=lambda o: -remaining[o])[:5])
            amount = 100 + self.rng.randrange(400)
        if amount > remaining[order_id]:
            raise RuntimeError("the sandbox's orders cannot fund so many pauses in one round")
        remaining[order_id] -= amount
        kind = "large" if large else "small"
        return {"order_id": order_id, "amount_cents": amount, "reason": f"chaos {kind} refund"}

    # --- workers ----------------------------------------------------------------------------

    def _worker_env(self, crash_at: str | None, pause_at: str | None = None) -> dict[str, str]:
        env = self._base_env()
        env.update(
            {
                "DATABASE_URL": self._worker_db_url(),
                "DJANGO_SETTINGS_MODULE": os.environ.get(
                    "DJANGO_SETTINGS_MODULE", "agentops.settings"
                ),
                "AGENTOPS_SANDBOX_URL": self.sandbox.url,
                "PYTHONUNBUFFERED": "1",
            }
        )
        # the workers declare what this round's sandbox honours (agentops/demo/tools.py)
        switches = SANDBOX_MODES.get(self.mode, SANDBOX_MODES["nothing"])
        env["AGENTOPS_SANDBOX_HONOURS"] = switches["honours"]
        env["AGENTOPS_SANDBOX_RESEND"] = switches["resend"]
        env.pop("AGENTOPS_CRASH_AT", None)
        env.pop("AGENTOPS_PAUSE_AT", None)
        if self.sink is not None:
            env.update(
                {
                    "EMAIL_BACKEND": "django.core.mail.backends.smtp.EmailBackend",
                    "EMAIL_HOST": "127.0.0.1",
                    "EMAIL_PORT": str(self.sink.port),
                }
            )
        if crash_at:
            env["AGENTOPS_CRASH_AT"] = crash_at
            env["AGENTOPS_Q_WORKERS"] = "4" if crash_at in NEEDS_COMPANY else "1"
        if pause_at:
            env["AGENTOPS_PAUSE_AT"] = pause_at
            env["AGENTOPS_Q_WORKERS"] = "1"
        return env

    def _base_env(self) -> dict[str, str]:
        env = dict(os.environ)
        for key, value in WORKER_DEFAULTS.items():
            env.setdefault(key, value)
        return env

    def pause_seconds(self) -> float:
        """Longer than the lease TTL + the landing window (send window + the refund tool's
        timeout + the margin), in the workers' settings: by then another worker has taken
        the run over and, where it must, sent again."""
        env = self._base_env()
        ttl = float(env["AGENTOPS_LEASE_TTL"])
        landing = (
            min(float(env["AGENTOPS_SEND_WINDOW"]), ttl)
            + float(env["AGENTOPS_SANDBOX_TIMEOUT"])
            + float(env["AGENTOPS_REDISPATCH_MARGIN"])
        )
        return ttl + landing + 1.0

    def _worker_db_url(self) -> str:
        """On PostgreSQL the workers' connections carry an application_name, so the database
        faults terminate theirs and never the harness's own."""
        if connection.vendor != "postgresql":
            return self.db_url
        return f"{self.db_url}{'&' if '?' in self.db_url else '?'}application_name={WORKER_APP}"

    def _start(
        self,
        slot: int,
        crash_at: str | None = None,
        *,
        pause_at: str | None = None,
        name: str = "",
    ) -> WorkerProcess:
        self.incarnations[slot] += 1
        name = name or f"{self.tag}-w{slot}"
        log_path = self.tmp / f"{name.removeprefix(self.tag + '-')}.{self.incarnations[slot]}.log"
        # its own process group: we kill the whole group
        process = workerprocs.spawn(
            ["runworker", "--name", name],
            env=self._worker_env(crash_at, pause_at),
            log_path=log_path,
        )
        worker = WorkerProcess(slot, name, crash_at, process, log_path)
        self.last_start = time.monotonic()
        self.starts.append(datetime.now(UTC))
        if name == f"{self.tag}-w{slot}":
            self.workers[slot] = worker
        else:
            self.pausers.append(worker)
        return worker

    def _affected(self, name: str) -> list[Any]:
        """Runs the dead worker held: still marked running under its name."""
        from runs.models import Run

        return list(
            Run.objects.filter(
                id__in=self.run_ids, lease_owner=name, status=Run.Status.RUNNING
            ).values_list("id", flat=True)
        )

    def _kill(self, worker: WorkerProcess) -> Kill:
        with suppress(ProcessLookupError, PermissionError):
            os.killpg(worker.process.pid, signal.SIGKILL)
        worker.process.wait()
        return self._record_kill(worker, None)

    def _record_kill(self, worker: WorkerProcess, boundary: str | None) -> Kill:
        kill = Kill(
            worker=worker.name,
            boundary=boundary,
            at=datetime.now(UTC),
            returncode=worker.process.returncode,
            affected=self._affected(worker.name),
        )
        self.kills.append(kill)
        return kill

    def _stop(self, worker: WorkerProcess, grace: float = 15.0) -> None:
        """SIGTERM to the main process only (django-q2 hangs on a group SIGTERM)."""
        with suppress(ProcessLookupError, PermissionError):
            os.killpg(worker.process.pid, signal.SIGCONT)  # a frozen one cannot stop
        if worker.alive:
            with suppress(ProcessLookupError):
                worker.process.send_signal(signal.SIGTERM)
            end = time.monotonic() + grace
            while worker.alive and time.monotonic() < end:
                time.sleep(POLL)
        with suppress(ProcessLookupError, PermissionError):
            os.killpg(worker.process.pid, signal.SIGKILL)
        worker.process.wait()

    # --- the loop's chores --------------------------------------------------------------------

    def _tick(self) -> None:
        if time.monotonic() > self.deadline:
            raise _Timeout
        self._approve_due()
        self._db_fault_due()
        for slot, worker in list(self.workers.items()):
            if worker.crash_at is None and not worker.alive:
                # an ordinary worker died on its own: that is a finding, and it is restarted.
                # Under --db-faults too: a worker outlives a lost database connection.
                self.keep_logs = True
                self.workers_restarted += 1
                self.notes.append(
                    f"worker {worker.name} exited on its own with {worker.process.returncode}"
                )
                self.out(
                    f"worker {worker.name} exited ({worker.process.returncode}):\n"
                    f"{worker.log_tail()}"
                )
                self._start(slot)

    def _db_fault_due(self) -> None:
        now = time.monotonic()
        if not self.opts.db_faults or now > self.db_faults_until or now < self.next_db_fault:
            return
        self.next_db_fault = now + self.rng.uniform(*DB_FAULT_INTERVAL)
        if self.pg_restart_due:
            self.pg_restart_due = False
            self._restart_postgres()
            return
        with connection.cursor() as cursor:
            cursor.execute(
                "SELECT count(*) FROM (SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                "WHERE datname = current_database() AND application_name = %s "
                "AND pid <> pg_backend_pid()) AS killed",
                [WORKER_APP],
            )
            terminated = cursor.fetchone()[0]
        self.connections_terminated += terminated
        if terminated:
            self.out(f"terminated {terminated} worker database connection(s)", level=2)

    def _restart_postgres(self) -> None:
        """Once, mid-way: the operator's command restarts the server under everyone."""
        self.out(f"restarting PostgreSQL: {self.opts.pg_restart_cmd}")
        connection.close()
        result = subprocess.run(
            self.opts.pg_restart_cmd, shell=True, capture_output=True, text=True, timeout=120
        )
        if result.returncode != 0:
            detail = (result.stderr or result.stdout).strip().splitlines()
            raise RuntimeError(
                f"--pg-restart-cmd failed ({result.returncode}): {detail[-1] if detail else ''}"
            )
        self.pg_restarts += 1
        end = time.monotonic() + 60
        while True:  # until the server accepts connections again
            try:
                connection.close()
                connection.ensure_connection()
                return
            except DatabaseError:
                if time.monotonic() > end:
                    raise
                time.sleep(0.5)

    def _sleep(self, seconds: float) -> None:
        end = time.monotonic() + seconds
        while True:
            self._tick()
            left = end - time.monotonic()
            if left <= 0:
                return
            time.sleep(min(0.05, left))

    def _approve_due(self) -> None:
        """The approver: decides each pending approval after a person's moment of thought,
        through the link in the email it received (or, without an SMTP sink, through the
        service the pages and links use). An approval without an email
        ``NOTIFY_GRACE_SECONDS`` after it appeared is a lost notification: decided through
        the service then, so that its run can end."""
        from approvals.models import Approval

        now = time.monotonic()
        pending = Approval.objects.filter(
            run_id__in=self.run_ids, status=Approval.Status.PENDING
        ).values_list("id", flat=True)
        for approval_id in pending:
            key = str(approval_id)
            first_seen = self.approval_seen.setdefault(approval_id, now)
            if self.sink is None:
                if now >= first_seen + self._thought(key):
                    self._decide_directly(approval_id)
                continue
            emails = self.sink.about_approval(approval_id, APPROVER_EMAIL)
            if emails:
                if now >= emails[0].at + self._thought(key):
                    self._decide_by_link(approval_id, emails[-1].approval_link_path)
            elif now - max(first_seen, self.last_start) > NOTIFY_GRACE_SECONDS:
                # no email within the grace of the approval appearing and of the latest
                # worker start (a worker killed at a notify point had just been started)
                self.unnotified.add(key)
                self.out(f"approval {key}: no email after {NOTIFY_GRACE_SECONDS:.0f}s")
                self._decide_directly(approval_id)

    def _thought(self, key: str) -> float:
        return self.approval_due.setdefault(key, self.rng.uniform(0.05, 0.5))

    def _decide_directly(self, approval_id: Any) -> None:
        from approvals.services import AlreadyDecided, ApprovalExpired, approval_decide
        from runs.actors import Actor

        with suppress(AlreadyDecided, ApprovalExpired):
            approval_decide(
                approval_id=approval_id,
                decision="approve",
                actor=Actor.for_user(self.approver, "cli"),
                comment="approved by the chaos harness",
            )

    def _decide_by_link(self, approval_id: Any, path: str) -> None:
        """What a person does with the email: opens the link signed in, reads the page,
        ticks the box and approves. Before them, a mail scanner opens the link and submits
        its form as it is (signed out, and in the approver's own browser): it must decide
        nothing (``scanner_decisions``)."""
        from urllib.parse import urlsplit

        from django.test import Client

        from approvals.models import Approval

        base = urlsplit(settings.AGENTOPS["BASE_URL"])
        host, secure = base.hostname or "localhost", base.scheme == "https"
        browser = Client(HTTP_HOST=host)
        browser.force_login(self.approver)
        scanner = Client(HTTP_HOST=host)
        scanner.get(path, secure=secure)
        scanner.post(path, {"decision": "approve"}, secure=secure)
        browser.post(path, {"decision": "approve"}, secure=secure)  # the box left unticked
        if not Approval.objects.filter(id=approval_id, status=Approval.Status.PENDING).exists():
            self.scanner_decisions.append(str(approval_id))
            self.notes.append(f"approval {approval_id}: decided by a link scanner")
            return
        page = browser.get(path, secure=secure)
        answer = None
        if page.status_code == 200 and b'name="decision"' in page.content:
            answer = browser.post(
                path,
                {"decision": "approve", "comment": "approved by link", "confirm": "yes"},
                secure=secure,
            )
        if Approval.objects.filter(id=approval_id, status=Approval.Status.PENDING).exists():
            status = answer.status_code if answer is not None else page.status_code
            self.broken_links.append(str(approval_id))
            self.notes.append(f"approval {approval_id}: its emailed link did not decide ({status})")
            self._decide_directly(approval_id)

    def _all_terminal(self) -> bool:
        """Every run is terminal — or, made in the ``person`` round, parked for a person."""
        from runs.models import Run

        open_runs = Run.objects.filter(id__in=self.run_ids).exclude(status__in=Run.TERMINAL)
        return not any(
            not self._parked_for_person(run_id, status, reason)
            for run_id, status, reason in open_runs.values_list("id", "status", "reason_code")
        )

    def _parked_for_person(self, run_id: Any, status: str, reason: str) -> bool:
        """``resend: person``: an absent lookup goes to an operator, not lost (DESIGN §9)."""
        from runs.models import Run

        return (
            self.run_mode.get(str(run_id)) == "person"
            and status == Run.Status.NEEDS_ATTENTION
            and reason == Run.Reason.UNKNOWN_OUTCOME
        )

    # --- phases ---------------------------------------------------------------------------------

    def _boundary_phase(self) -> None:
        """One worker at a time, restarted with AGENTOPS_CRASH_AT for each boundary in turn.
        It alone advances the runs, so it reaches the boundary soon; a kill that cannot be
        proven (the worker held no run then) is tried again."""
        # Boundaries that can only be proven while the dying worker holds ANOTHER run (its
        # own run has released the lease) go first, while every run is still in flight.
        pending = deque(sorted(self.opts.boundaries, key=KILL_ORDER.index))
        attempts: Counter[str] = Counter()
        while pending:
            if self._all_terminal():
                # the outbox's kills bring their own run; the others need runs in flight
                self.unreached.extend(b for b in pending if b not in NOTIFY_BOUNDARIES)
                pending = deque(b for b in pending if b in NOTIFY_BOUNDARIES)
                if not pending:
                    break
            boundary = pending.popleft()
            attempts[boundary] += 1
            if boundary in NOTIFY_BOUNDARIES or (
                boundary == "approval_requested" and attempts[boundary] > 1
            ):
                # an approval request of its own, so the email is there to be sent (and a
                # retried approval_requested kill has a gate to reach)
                self._create_run(self._pause_plan(large=True), f"kill at {boundary}")
            worker = self._start(0, crash_at=boundary)
            end = time.monotonic() + ATTEMPT_SECONDS
            while worker.alive and time.monotonic() < end:
                self._tick()
                time.sleep(POLL)
            if worker.alive:
                self._stop(worker)
                self.out(f"no run reached {boundary} within {ATTEMPT_SECONDS:.0f}s")
                if attempts[boundary] < 2:
                    pending.append(boundary)
                else:
                    self.unreached.append(boundary)
                continue
            kill = self._record_kill(worker, boundary)
            crashed_here = f"killing process group at {boundary}" in worker.log()
            self.out(
                f"{worker.name} died at {boundary} (exit {kill.returncode}); "
                f"held {len(kill.affected)} run(s)"
            )
            if not crashed_here or not kill.sigkilled:
                kill.boundary = None  # died, but not provably at this boundary
                self.keep_logs = True
                self.notes.append(f"{worker.name} died at {boundary} unexpectedly")
                self.out(worker.log_tail())
            unproven = kill.boundary is None or (
                not kill.affected and boundary not in NOTIFY_BOUNDARIES
            )
            if unproven and attempts[boundary] < ATTEMPTS_PER_BOUNDARY:
                pending.append(boundary)
            elif unproven:
                self.unreached.append(boundary)

    def _random_phase(self) -> None:
        for slot in range(self.opts.workers):
            if slot not in self.workers or not self.workers[slot].alive:
                self._start(slot)
        if self.opts.db_faults:
            # from now until a while into the drain; the restart half-way through the kills
            self.db_faults_until = float("inf")
            self.pg_restart_due = bool(self.opts.pg_restart_cmd) and not self.opts.random_kills
        kills = self.opts.random_kills
        for number in range(kills):
            # spread the held-back runs over the kills
            due = len(self.plans) - self.held_back + self.held_back * (number + 1) // kills
            self._create_runs(max(0, due - len(self.run_ids)))
            self._sleep(self.rng.uniform(0.3, 1.5))
            if self.opts.pg_restart_cmd and number == kills // 2 and not self.pg_restarts:
                self.pg_restart_due = True
            slot = self.rng.choice(sorted(self.workers))
            worker = self.workers[slot]
            kill = self._kill(worker)
            self.out(
                f"random kill {number + 1}/{self.opts.random_kills}: {worker.name} "
                f"(exit {kill.returncode}); held {len(kill.affected)} run(s)"
            )
            self._start(slot)

    # --- pauses (DESIGN §9) -----------------------------------------------------------------

    def _pause_phase(self) -> None:
        for number in range(self.opts.pauses):
            if number < len(PAUSE_FIRST):
                boundary: str | None = PAUSE_FIRST[number]
            elif (number - len(PAUSE_FIRST)) % 2 == 0:
                boundary = None
            else:
                boundary = PAUSE_CYCLE[self.pause_cycle % len(PAUSE_CYCLE)]
                self.pause_cycle += 1
            name = f"{self.tag}-p{len(self.pauses) + len(self.unpaused) + 1}"
            pause = self._pause_at(boundary, name) if boundary else self._pause_randomly(name)
            if pause is None:
                continue
            self.out(
                f"{self.mode} pause {number + 1}/{self.opts.pauses} "
                f"({pause.boundary or 'random'}): {name} frozen {pause.seconds:.1f}s holding "
                f"{len(pause.affected)} run(s); {pause.refused} write(s) refused after SIGCONT"
            )

    def _pause_at(self, boundary: str, name: str) -> Pause | None:
        """A fresh run that a worker started with AGENTOPS_PAUSE_AT advances alone until it
        freezes itself at ``boundary``; then the ordinary workers take over."""
        self._settle()
        for worker in list(self.workers.values()):
            self._stop(worker)
        self.workers.clear()
        spec, large = PAUSE_SPECS[boundary]
        self._create_run(self._pause_plan(large=large), f"pause at {boundary}")
        pauser = self._start(0, pause_at=spec, name=name)
        end = time.monotonic() + ATTEMPT_SECONDS
        while not (_frozen(pauser) and f"freezing process group at {boundary}" in pauser.log()):
            if not pauser.alive or time.monotonic() > end:
                self._stop(pauser)
                self.unpaused.append(boundary)
                self.notes.append(f"{name} did not freeze at {boundary}")
                self.keep_logs = True
                self.out(f"{name} did not freeze at {boundary}:\n{pauser.log_tail()}")
                self._start_workers()
                return None
            self._tick()
            time.sleep(POLL)
        pause = self._frozen_pause(pauser, boundary)
        self._start_workers()
        return self._resume(pauser, pause)

    def _pause_randomly(self, name: str) -> Pause:
        """An ordinary worker frozen at a random moment of its work on fresh runs (with one
        worker, a second one is started to be frozen, so that someone can take over)."""
        self._start_workers()
        for _ in range(3):
            self._create_run(self._pause_plan(large=False), "random pause")
        if self.opts.workers > 1:
            victim = self.workers[self.rng.choice(sorted(self.workers))]
        else:
            victim = self._start(0, name=name)
            end = time.monotonic() + ATTEMPT_SECONDS
            while f"worker {name} running" not in victim.log() and time.monotonic() < end:
                self._tick()
                time.sleep(POLL)
        self._sleep(self.rng.uniform(0.2, 1.5))
        offset = len(victim.log())
        with suppress(ProcessLookupError, PermissionError):
            os.killpg(victim.process.pid, signal.SIGSTOP)
        pause = self._frozen_pause(victim, None)
        return self._resume(victim, pause, since=offset, stop=victim in self.pausers)

    def _frozen_pause(self, pauser: WorkerProcess, boundary: str | None) -> Pause:
        pause = Pause(
            worker=pauser.name,
            boundary=boundary,
            mode=self.mode,
            at=datetime.now(UTC),
            affected=self._affected(pauser.name),
        )
        self.pauses.append(pause)
        return pause

    def _resume(
        self, pauser: WorkerProcess, pause: Pause, *, since: int = 0, stop: bool = True
    ) -> Pause:
        """Frozen past the lease and the landing window, resumed, and left to run on until
        the fence refused its writes (or a few seconds, when it held nothing). Its log
        from ``since`` on says what was refused; ``stop``: then it is stopped."""
        started = time.monotonic()
        self._sleep(self.pause_seconds())
        with suppress(ProcessLookupError, PermissionError):
            os.killpg(pauser.process.pid, signal.SIGCONT)
        pause.seconds = time.monotonic() - started
        end = time.monotonic() + (RUN_ON_SECONDS if pause.affected else 1.0)
        while time.monotonic() < end and pauser.alive:
            refused = pauser.log()[since:].count(LEASE_LOST_LINE)
            if pause.affected and refused >= len(pause.affected):
                break
            self._tick()
            time.sleep(POLL)
        if stop:
            self._stop(pauser)
        pause.refused = pauser.log()[since:].count(LEASE_LOST_LINE)
        return pause

    def _start_workers(self) -> None:
        for slot in range(self.opts.workers):
            if slot not in self.workers or not self.workers[slot].alive:
                self._start(slot)

    def _settle(self) -> None:
        """Until the round's runs so far are done (with the ordinary workers running)."""
        if not self._all_terminal():
            self._start_workers()
        while not self._all_terminal():
            self._sleep(0.1)

    def _drain(self) -> None:
        self._create_runs(len(self.plans))
        if self.opts.db_faults:
            self.db_faults_until = time.monotonic() + DB_FAULT_DRAIN_SECONDS
        for slot in range(self.opts.workers):
            if slot not in self.workers or not self.workers[slot].alive:
                self._start(slot)
        while not self._all_terminal():
            self._sleep(0.1)
        self.out("every run is terminal")

    # --- the verdict --------------------------------------------------------------------------

    def _recoveries(self) -> None:
        from runs.models import RunEvent

        for kill in self.kills:
            if not kill.affected:
                continue
            claims = (
                RunEvent.objects.filter(
                    run_id__in=kill.affected,
                    type=EventType.RUN_CLAIMED,
                    created_at__gte=kill.at,
                    payload__recovered=True,
                )
                .order_by("created_at")
                .values_list("run_id", "created_at")
            )
            for run_id, created_at in claims:
                kill.recovered_after.setdefault(str(run_id), (created_at - kill.at).total_seconds())

    def report(self) -> tuple[dict[str, Any], list[str]]:
        from approvals.models import Approval
        from runs.models import Run, RunEvent, ToolReceipt

        self._recoveries()
        for kill in self.kills:
            self.out(
                f"kill of {kill.worker} at {kill.at:%H:%M:%S.%f} "
                f"({kill.boundary or 'random'}, exit {kill.returncode}): held "
                f"{len(kill.affected)}, first recovered claim after "
                + (f"{min(kill.recovered_after.values()):.2f}s" if kill.recovered_after else "-"),
                level=2,
            )
        runs = {
            str(run.id): run
            for run in Run.objects.filter(id__in=self.run_ids).only(
                "id", "status", "result", "root_run_id", "reason_code", "reason_detail"
            )
        }
        refunds = self.refunds
        per_key = Counter(refund["idempotency_key"] for refund in refunds)
        keys_per_run: dict[str, set[str]] = {}
        rows_per_run: Counter[str] = Counter()
        for refund in refunds:
            run_key = refund["idempotency_key"].rsplit(":", 1)[0]
            keys_per_run.setdefault(run_key, set()).add(refund["idempotency_key"])
            rows_per_run[run_key] += 1
        duplicated = {key.rsplit(":", 1)[0] for key, count in per_key.items() if count > 1}
        duplicate_effects = len([key for key, count in per_key.items() if count > 1]) + sum(
            1 for run_id in runs if len(keys_per_run.get(run_id, ())) > 1
        )
        duplicated |= {run_id for run_id in runs if len(keys_per_run.get(run_id, ())) > 1}
        modes = (
            [KILL_ROUND]
            if any(self.run_mode.get(run_id, KILL_ROUND) == KILL_ROUND for run_id in runs)
            else []
        )
        modes += [mode for mode in self.opts.sandbox_modes if self.opts.pauses]
        duplicates_by_mode = {
            mode: sum(1 for run_id in duplicated if self.run_mode.get(run_id, KILL_ROUND) == mode)
            for mode in modes
        }
        # DESIGN §9: what remains with a downstream that honours nothing is a pause between
        # the pre-send check and the request's last byte: a duplicate there is reported, not
        # a broken invariant; anywhere else it is
        before_send = {
            str(run_id)
            for pause in self.pauses
            if pause.boundary == "before_send" and pause.mode == "nothing"
            for run_id in pause.affected
        }
        unexplained = [
            run_id
            for run_id in duplicated
            if not (self.run_mode.get(run_id) == "nothing" and run_id in before_send)
        ]

        refund_receipts = set(
            ToolReceipt.objects.filter(
                tool_call__run_id__in=self.run_ids,
                tool_call__tool_name="refund_payment",
                outcome=ToolReceipt.Outcome.SUCCEEDED,
            ).values_list("tool_call__run_id", flat=True)
        )
        refund_receipts = {str(run_id) for run_id in refund_receipts}
        lost = []
        parked_for_person = 0
        for run_id, run in runs.items():
            if self._parked_for_person(run_id, run.status, run.reason_code):
                parked_for_person += 1
            elif run.status not in Run.TERMINAL:
                lost.append((run_id, f"still {run.status} {run.reason_code}".strip()))
            elif run.status == Run.Status.SUCCEEDED and (
                run_id not in refund_receipts
                or not (run.result or {}).get("refunded")
                or rows_per_run[run_id] == 0
            ):
                # (more than one refund is a duplicate effect, counted above)
                lost.append((run_id, "succeeded without its refund or its receipt"))

        consumed_events = Counter(
            (str(run_id), payload.get("seq"))
            for run_id, payload in RunEvent.objects.filter(
                run_id__in=self.run_ids, type=EventType.APPROVAL_CONSUMED
            ).values_list("run_id", "payload")
        )
        consumed_rows = Counter(
            Approval.objects.filter(run_id__in=self.run_ids, consumed_at__isnull=False).values_list(
                "tool_call_id", flat=True
            )
        )
        double_consumed = sum(1 for count in consumed_events.values() if count > 1) + sum(
            1 for count in consumed_rows.values() if count > 1
        )
        approvals = Approval.objects.filter(run_id__in=self.run_ids).count()
        unknown_keys = {
            payload.get("idempotency_key")
            for payload in RunEvent.objects.filter(
                run_id__in=self.run_ids, type=EventType.TOOL_UNKNOWN
            ).values_list("payload", flat=True)
        }

        notifications = self._notifications()

        proven = {kill.boundary for kill in self.kills if kill.boundary and kill.proven}
        boundaries_killed = [name for name in BOUNDARIES if name in proven]
        # per kill: until the first run it held was claimed again, recovered
        recovery_times = [
            min(kill.recovered_after.values()) for kill in self.kills if kill.recovered_after
        ]
        succeeded = sum(1 for run in runs.values() if run.status == Run.Status.SUCCEEDED)
        missing = [name for name in self.opts.boundaries if name not in proven]
        report = {
            "runs": len(self.run_ids),
            "succeeded": succeeded,
            "kills": sum(1 for kill in self.kills if kill.sigkilled),
            "boundaries_killed": boundaries_killed,
            "duplicate_effects": duplicate_effects,
            "lost_runs": len(lost),
            "double_consumed_approvals": double_consumed,
            "max_recovery_seconds": round(max(recovery_times), 2) if recovery_times else None,
            "boundaries_missing": missing,
            "approvals": approvals,
            "refunds": len(refunds),
            "unknown_outcomes": len(unknown_keys),
            "pauses": len(self.pauses),
            "pause_boundaries": [
                name for name in BOUNDARIES if any(p.boundary == name for p in self.pauses)
            ],
            "random_pauses": sum(1 for pause in self.pauses if pause.boundary is None),
            "zombie_writes_refused": sum(pause.refused for pause in self.pauses),
            "late_sends": len(self.late_requests),
            "late_sends_applied": sum(1 for r in self.late_requests if r["applied"]),
            "late_sends_refused": sum(1 for r in self.late_requests if r["refused"]),
            "tool_concurrency": self.opts.tool_concurrency,
            "tool_rate": self.opts.tool_rate,
            "max_in_flight_calls": self.max_in_flight_calls,
            "peak_requests_per_second": self.peak_requests_per_second,
            "duplicate_effects_by_mode": duplicates_by_mode,
            "parked_for_person": parked_for_person,
            "db_connections_terminated": self.connections_terminated,
            "pg_restarts": self.pg_restarts,
            "workers_restarted": self.workers_restarted,
            **notifications,
            "database": connection.vendor,
            "seed": self.opts.seed,
            "elapsed_seconds": round(time.monotonic() - self.started, 1),
        }
        problems = []
        if unexplained:
            problems.append(f"{duplicate_effects} duplicate side effect(s)")
        elif duplicate_effects:
            self.out(
                f"{duplicate_effects} duplicate side effect(s), all in the 'nothing' round on "
                "runs paused at before_send: what remains with a downstream that honours "
                "neither key nor deadline (docs/agents.md)"
            )
        limit = self.opts.tool_concurrency
        if limit is not None and self.max_in_flight_calls > limit:
            problems.append(
                f"the sandbox had {self.max_in_flight_calls} refunds in flight at once "
                f"(limit {limit})"
            )
        late_unrefused = [
            r for r in self.late_requests if r["mode"] == "deadline" and not r["refused"]
        ]
        if late_unrefused:
            problems.append(
                f"{len(late_unrefused)} late send(s) applied by a sandbox checking deadlines"
            )
        missing_pauses = sorted(set(self.unpaused))
        if missing_pauses:
            self.out(f"could not pause at: {', '.join(missing_pauses)}")
        if lost:
            problems.append(
                f"{len(lost)} lost run(s): "
                + ", ".join(f"{run_id} ({why})" for run_id, why in lost[:5])
            )
        if double_consumed:
            problems.append(f"{double_consumed} approval(s) consumed more than once")
        if notifications["lost_notifications"]:
            problems.append(f"{notifications['lost_notifications']} lost notification(s)")
        if (notifications["duplicate_notifications"] or 0) > notifications[
            "duplicate_notifications_allowed"
        ]:
            problems.append(
                f"{notifications['duplicate_notifications']} duplicate notification(s), "
                f"more than the {notifications['duplicate_notifications_allowed']} kills and "
                "pauses between a send and its mark explain"
            )
        failed = [
            (run_id, f"{run.status}: {run.reason_detail or run.reason_code}")
            for run_id, run in runs.items()
            if run.status in (Run.Status.FAILED, Run.Status.TERMINATED)
        ]
        if failed:
            # no kill should make a valid refund fail
            problems.append(
                f"{len(failed)} run(s) did not succeed: "
                + ", ".join(f"{run_id} ({why})" for run_id, why in failed[:3])
            )
        problems.extend(self.notes)
        if problems or missing:
            self.keep_logs = True
        if missing:
            self.out(f"could not prove a kill at: {', '.join(missing)}")
        if self.keep_logs:
            self.out(f"worker logs kept in {self.tmp}")
        return report, problems

    def _notifications(self) -> dict[str, Any]:
        """What the SMTP sink received against what should have been sent (DESIGN §9)."""
        from approvals.models import Approval

        if self.sink is None:
            return {
                "lost_notifications": None,
                "duplicate_notifications": None,
                "duplicate_notifications_allowed": 0,
                "max_notification_seconds": None,
                "scanner_decisions": None,
            }
        received = self.sink.snapshot()
        copies = Counter(m.message_id for m in received if m.message_id)
        duplicates = sum(count - 1 for count in copies.values())
        # a copy is explained by a kill or a pause between a send and its mark: at
        # notify_sent, at a random moment, or at any other boundary (a kill takes the whole
        # process group, whose sweeper may be sending at that moment): at most one each
        allowed = sum(1 for kill in self.kills if kill.sigkilled) + len(self.pauses)
        first_email: dict[str, datetime] = {}
        for message in received:
            if message.approval and APPROVER_EMAIL in message.to:
                first_email.setdefault(message.approval, message.at_wall)
        starts = sorted(self.starts)
        lost = set(self.unnotified) | set(self.broken_links)
        delays = []
        for approval_id, requested_at in Approval.objects.filter(
            run_id__in=self.run_ids
        ).values_list("id", "requested_at"):
            arrived = first_email.get(str(approval_id))
            if arrived is None:
                lost.add(str(approval_id))
                continue
            # from the request, or from the latest worker start before the email: how long
            # an approver waited with a worker alive
            alive_again = max([requested_at, *(t for t in starts if t <= arrived)])
            delays.append((arrived - alive_again).total_seconds())
        return {
            "lost_notifications": len(lost),
            "duplicate_notifications": duplicates,
            "duplicate_notifications_allowed": allowed,
            "max_notification_seconds": round(max(delays), 2) if delays else None,
            "scanner_decisions": len(self.scanner_decisions),
        }

    # --- clean-up -----------------------------------------------------------------------------

    def cleanup(self) -> None:
        """Stop every child: SIGTERM to each worker's main process, then SIGKILL whatever of
        its group is left; then the sandbox. Runs on every exit path, Ctrl-C included."""
        workers = list(self.workers.values()) + self.pausers
        for worker in workers:
            if worker.alive:
                with suppress(ProcessLookupError, PermissionError):
                    os.killpg(worker.process.pid, signal.SIGCONT)  # a frozen one cannot stop
                with suppress(ProcessLookupError):
                    worker.process.send_signal(signal.SIGTERM)
        end = time.monotonic() + 10
        while any(w.alive for w in workers) and time.monotonic() < end:
            time.sleep(POLL)
        for worker in workers:
            with suppress(ProcessLookupError, PermissionError):
                os.killpg(worker.process.pid, signal.SIGKILL)
            worker.process.wait()
        if self.limited:
            from runs import flow
            from runs.actors import Actor

            with suppress(DatabaseError):
                flow.tool_limit_remove(tool_name="refund_payment", actor=Actor.system("cli"))
        if self.sandbox is not None:
            self.sandbox.stop()
        if self.sink is not None:
            self.sink.stop()
        if not self.keep_logs:
            shutil.rmtree(self.tmp, ignore_errors=True)


class _Timeout(Exception):
    pass


def _frozen(worker: WorkerProcess) -> bool:
    """The worker's main process is stopped (SIGSTOP): state T in /proc."""
    return workerprocs.frozen(worker.process.pid)

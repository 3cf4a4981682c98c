"""Workers on two hosts — network namespaces with their own addresses, each reaching PostgreSQL
and the sandbox only through its own link (tests/runs/hosts.py). A partitioned host's worker
keeps running, cut off: the real zombie. The other host takes its runs over within the lease
TTL + 2 s, and once the link is back nothing the zombie held back applies a second refund.
Then a host dies wholesale, and the other takes over again."""

from __future__ import annotations

import subprocess
import time
from collections.abc import Callable
from datetime import datetime
from urllib.parse import quote, urlsplit, urlunsplit

import httpx
import pytest
from django.conf import settings
from django.db import connection

from agentops.demo.management.commands.chaos import database_url
from runs.dbtime import db_now
from runs.models import Run, RunEvent, ToolCall, Worker
from runs.services import run_create
from tests.runs.hosts import Host, Hosts, hosts_available
from tests.runs.workerprocs import wait_for, worker_env
from tests.support import refunds, set_faults

TTL = 4.0
# the bound: the other host claims a partitioned host's run within TTL + 2 s
TAKEOVER_WITHIN = TTL + 2.0
# a session cut off inside a transaction keeps its row locks until the server ends it; this
# ends it (docs/operations.md, "Several worker hosts"): shorter than the lease TTL
IDLE_IN_TRANSACTION_MS = 2000


@pytest.fixture
def two_hosts():
    reason = hosts_available()
    if reason:
        pytest.skip(reason)
    if connection.vendor != "postgresql":
        pytest.skip("workers on several hosts share a PostgreSQL database")
    made = Hosts()
    try:
        try:
            hosts = (made.add(), made.add())
        except subprocess.CalledProcessError as exc:
            pytest.skip(f"cannot make network namespaces here: {exc.stderr.strip()}")
        yield hosts
    finally:
        made.cleanup()


def _database_url(host: Host) -> str:
    """The test database, through the host's own link."""
    url = urlsplit(database_url())
    port = host.link.forward((url.hostname or "127.0.0.1", url.port or 5432))
    userinfo = url.netloc.rpartition("@")[0]
    netloc = f"{userinfo}@{host.gateway}:{port}" if userinfo else f"{host.gateway}:{port}"
    query = url.query
    if settings.PG_POOLER != "transaction":  # PgBouncer refuses the startup option
        option = "options=" + quote(
            f"-c idle_in_transaction_session_timeout={IDLE_IN_TRANSACTION_MS}"
        )
        query = f"{query}&{option}" if query else option
    return urlunsplit(url._replace(netloc=netloc, query=query))


def _host_env(host: Host, sandbox) -> dict[str, str]:
    return worker_env(
        sandbox,
        DATABASE_URL=_database_url(host),
        AGENTOPS_SANDBOX_URL=f"http://{host.gateway}:{host.link.forward(('127.0.0.1', sandbox.port))}",
        AGENTOPS_LEASE_TTL=str(TTL),
        # the sandbox refuses a request received after its send deadline (below): a refund
        # the cut held back cannot apply when it finally arrives
        AGENTOPS_SANDBOX_HONOURS="deadline",
    )


def _refund_run(system_actor, amount: int) -> Run:
    return run_create(
        agent_name="refund",
        input={"order_id": "ord_1002", "amount_cents": amount},
        actor=system_actor,
    )


def _refund_in_flight(owner: str) -> Run | None:
    """A run ``owner`` holds whose refund it has dispatched (its request is on the wire)."""
    call = (
        ToolCall.objects.filter(
            tool_name="refund_payment",
            status=ToolCall.Status.DISPATCHING,
            step__run__lease_owner=owner,
            step__run__status=Run.Status.RUNNING,
        )
        .select_related("step__run")
        .first()
    )
    return call.step.run if call else None


def _held_by(owner: str) -> list[Run]:
    return list(Run.objects.filter(lease_owner=owner, status=Run.Status.RUNNING))


def _claimed_by(run: Run, owner: str, after: datetime) -> RunEvent | None:
    return (
        RunEvent.objects.filter(run=run, type="run.claimed", payload__worker=owner)
        .filter(created_at__gt=after)
        .order_by("seq")
        .first()
    )


def _all_ended(runs: list[Run]) -> bool:
    statuses = set(Run.objects.filter(id__in=[r.id for r in runs]).values_list("status", flat=True))
    return statuses <= set(Run.TERMINAL)


def _assert_record_and_ledger(sandbox, runs: list[Run]) -> None:
    """Every run succeeded with a gap-free event log, and the sandbox applied one refund each."""
    assert {r.status for r in Run.objects.filter(id__in=[r.id for r in runs])} == {
        Run.Status.SUCCEEDED
    }
    for run in runs:
        seqs = list(RunEvent.objects.filter(run=run).order_by("seq").values_list("seq", flat=True))
        assert seqs == list(range(1, len(seqs) + 1))
    keys = sorted(refund["idempotency_key"] for refund in refunds(sandbox))
    assert keys == sorted(f"{run.id}:2" for run in runs), "a refund missing or applied twice"


def _lose_host_with_a_refund_on_the_wire(
    owner: str, lose: Callable[[], None], *, taker: str, runs: list[Run], more: Callable[[], Run]
):
    """Once ``owner`` has a refund on the wire, ``lose`` its host; ``taker`` must claim each
    run ``owner`` held within TAKEOVER_WITHIN. Both hosts' workers compete for the runs: while
    ``owner`` has none in flight, another run is started every 2 s (added to ``runs``), so
    the test never depends on which worker a wake-up reached first."""
    fed = [time.monotonic()]

    def owner_sending() -> Run | None:
        in_flight = _refund_in_flight(owner)
        if in_flight is None and time.monotonic() - fed[0] > 2 and len(runs) < 10:
            runs.append(more())
            fed[0] = time.monotonic()
        return in_flight

    in_flight = wait_for(owner_sending, 60, what=f"{owner} to send a refund")
    lose()
    lost_at = db_now()
    taken = _takeover(_held_by(owner), taker, lost_at)
    assert in_flight.id in taken, "the run with a refund on the wire was not taken over"
    assert max(taken.values()) <= TAKEOVER_WITHIN, f"{taker} took over after {taken}"


def _takeover(runs: list[Run], by: str, since: datetime) -> dict[object, float]:
    """Seconds from ``since`` until ``by`` claimed each of ``runs`` — but for a run whose last
    write was already on its way at the cut, and ended without needing anyone."""
    taken: dict[object, float] = {}
    for run in runs:
        claim = wait_for(
            lambda run=run: _claimed_by(run, by, since) or _ended_unclaimed(run, by, since),
            TAKEOVER_WITHIN + 20,
            what=f"{by} to claim run {run.id}",
        )
        if isinstance(claim, RunEvent):
            taken[run.id] = (claim.created_at - since).total_seconds()
    return taken


def _ended_unclaimed(run: Run, by: str, since: datetime) -> bool:
    ended = Run.objects.get(id=run.id).status in Run.TERMINAL
    return ended and _claimed_by(run, by, since) is None


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_a_partitioned_host_is_taken_over_in_time_and_a_dead_one_too(
    two_hosts, worker_procs, sandbox, system_actor
):
    host_a, host_b = two_hosts
    httpx.post(f"{sandbox.url}/mode", json={"deadline": True}, timeout=5).raise_for_status()
    # every refund takes a second in the sandbox: a host is cut off or killed with one on the
    # wire (received, applied a moment later, the answer lost to the cut)
    set_faults(sandbox, latency_ms=1000)
    worker_a = worker_procs.start("host-a", _host_env(host_a, sandbox), host_a.command_prefix)
    worker_b = worker_procs.start("host-b", _host_env(host_b, sandbox), host_b.command_prefix)
    worker_a.wait_running(timeout=60)
    worker_b.wait_running(timeout=60)

    # --- a partition: host A's worker runs on, cut off from the database and the sandbox ---
    first = [_refund_run(system_actor, 100 + n) for n in range(4)]
    _lose_host_with_a_refund_on_the_wire(
        "host-a",
        host_a.link.cut,
        taker="host-b",
        runs=first,
        more=lambda: _refund_run(system_actor, 100 + len(first)),
    )
    wait_for(lambda: _all_ended(first), 60, what="host B to finish every run")
    assert worker_a.alive, "the partitioned worker should still be running"

    # the link is back: whatever host A held back now arrives, late; its worker reconnects
    # under its own identity, and none of its writes or requests does anything twice
    restored_at = db_now()
    host_a.link.restore()
    wait_for(
        lambda: Worker.objects.get(name="host-a").heartbeat_at > restored_at,
        30,
        what="host A to reconnect",
    )
    _assert_record_and_ledger(sandbox, first)

    # --- a host dies wholesale: its network and every process on it, at once ---------------
    def power_off() -> None:
        host_b.link.cut()  # a dead machine sends nothing more, not even a reset
        host_b.kill_everything()

    second = [_refund_run(system_actor, 200 + n) for n in range(3)]
    _lose_host_with_a_refund_on_the_wire(
        "host-b",
        power_off,
        taker="host-a",
        runs=second,
        more=lambda: _refund_run(system_actor, 200 + len(second)),
    )
    wait_for(lambda: _all_ended(second), 60, what="host A to finish every run")
    assert worker_b.process.wait(timeout=10) == -9  # SIGKILLed with everything on its host
    _assert_record_and_ledger(sandbox, first + second)


def test_hosts_are_skipped_cleanly_without_root(monkeypatch):
    monkeypatch.setattr("os.geteuid", lambda: 1000)

    assert hosts_available() == "network namespaces need root"

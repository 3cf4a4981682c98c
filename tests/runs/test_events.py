"""The audit record: gap-free per-run sequence, a hash chain, and no rewriting of history."""

from __future__ import annotations

import threading

import pytest
from django.db import DatabaseError, connection, transaction

from approvals.models import Approval
from approvals.services import approval_decide
from runs import engine
from runs.actors import Actor
from runs.models import AppendOnlyError, Run, RunEvent, Step
from runs.record.chain import anchor_hash, event_hash, payload_digest
from runs.record.checkpoint import LeaseLost, checkpoint
from runs.registry import CallTool, Finish
from runs.services import run_create, run_terminate
from tests.conftest import drive
from tests.support import CountingTool, ScriptedAgent, close_connection, expire_lease, make_tool

pytestmark = pytest.mark.usefixtures("roles")


def assert_intact(run_id) -> list[RunEvent]:
    """What an auditor checks: seq 1..n without gaps, every event hashed over its own
    fields and linked to the one before, the first anchored to the run, the run pointing
    at the last."""
    run = Run.objects.get(id=run_id)
    chain = list(RunEvent.objects.filter(run_id=run_id).order_by("seq"))
    assert [e.seq for e in chain] == list(range(1, len(chain) + 1))
    previous = anchor_hash(run.id)
    for event in chain:
        assert event.prev_hash == previous, f"event {event.seq} does not link to {event.seq - 1}"
        assert event.payload_digest == payload_digest(event.payload)
        assert event.hash == event_hash(event), f"event {event.seq} does not match its hash"
        previous = event.hash
    assert (run.event_seq, run.last_event_hash) == (len(chain), previous)
    return chain


@pytest.mark.django_db
def test_engine_and_service_writes_share_one_gap_free_chain(
    sandbox, system_actor, approver, operator
):
    run = run_create(
        agent_name="refund",
        input={"order_id": "ord_1004", "amount_cents": 50_000},
        actor=system_actor,
    )
    drive(run.id)  # engine: claimed, decided, approval requested
    approval = Approval.objects.get(run=run)
    approval_decide(  # service
        approval_id=approval.id, decision="approve", actor=Actor.for_user(approver, "email")
    )
    drive(run.id)  # engine: dispatch, receipt, finish

    chain = assert_intact(run.id)

    writers = {(e.actor, e.channel) for e in chain}
    assert ("user:alice", "email") in writers
    assert ("worker:test-worker", "worker") in writers
    assert ("system", "cli") in writers
    assert len({e.seq for e in chain}) == len(chain)


@pytest.mark.django_db
def test_terminated_run_keeps_an_intact_chain(sandbox, system_actor, operator):
    run = run_create(
        agent_name="refund",
        input={"order_id": "ord_1004", "amount_cents": 50_000},
        actor=system_actor,
    )
    drive(run.id)
    run_terminate(run_id=run.id, actor=Actor.for_user(operator, "web"), reason="stop")

    chain = assert_intact(run.id)
    assert chain[-1].type == "run.terminated"


@pytest.mark.django_db
def test_tampered_event_breaks_the_chain(sandbox, system_actor):
    run = drive(
        run_create(
            agent_name="refund",
            input={"order_id": "ord_1001", "amount_cents": 500},
            actor=system_actor,
        ).id
    )
    chain = assert_intact(run.id)
    forged = chain[2]
    forged.payload = {**forged.payload, "amount_cents": 1}

    assert payload_digest(forged.payload) != forged.payload_digest
    forged.payload_digest = payload_digest(forged.payload)
    assert event_hash(forged) != forged.hash


@pytest.mark.django_db(transaction=True)
def test_concurrent_writers_never_share_or_skip_a_seq(register, system_actor):
    body = CountingTool()

    def decide(ctx):
        if len(ctx.steps) < 15:
            return CallTool("chain_read", {})
        return Finish({})

    register(make_tool("chain_read", body), ScriptedAgent("chainer", decide, tools=("chain_read",)))
    run = run_create(agent_name="chainer", actor=system_actor)
    start = threading.Barrier(3)
    errors: list[BaseException] = []

    def worker() -> None:
        try:
            start.wait(timeout=5)
            assert engine.advance(run.id, worker="w1") == "parked"
        except BaseException as exc:
            errors.append(exc)
        finally:
            close_connection()

    def operator_notes(name: str) -> None:
        # people annotating the run while the worker writes: the same one append path
        try:
            start.wait(timeout=5)
            for i in range(15):
                with checkpoint(run.id, actor=f"user:{name}", channel="web") as cp:
                    cp.event("run.note", text=f"{name} {i}")
        except BaseException as exc:
            errors.append(exc)
        finally:
            close_connection()

    threads = [
        threading.Thread(target=worker),
        threading.Thread(target=operator_notes, args=("olivia",)),
        threading.Thread(target=operator_notes, args=("oscar",)),
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)

    assert errors == []
    chain = assert_intact(run.id)
    assert sum(e.type == "run.note" for e in chain) == 30
    assert Run.objects.get(id=run.id).status == Run.Status.SUCCEEDED


# --- a lease holder's write without a lock (checkpoint(expect=...)) -------------------------


# the write without a lock is PostgreSQL's; elsewhere checkpoint(expect=...) locks as usual
postgresql_only = pytest.mark.skipif(
    connection.vendor != "postgresql", reason="the write without a lock is PostgreSQL's"
)


@pytest.fixture
def noter(register, system_actor) -> Run:
    register(
        make_tool("note_read", CountingTool()),
        ScriptedAgent(
            "noter",
            lambda ctx: Finish({}) if ctx.steps else CallTool("note_read", {}),
            tools=("note_read",),
        ),
    )
    return run_create(agent_name="noter", actor=system_actor)


@postgresql_only
@pytest.mark.django_db(transaction=True)
def test_a_write_without_lock_goes_after_what_others_wrote_meanwhile(noter, operator):
    """The worker's hot path does not lock the run before it records a step: an operator
    who writes in between (here: asks to terminate) is not overwritten or interleaved — the
    worker's events follow the operator's in one intact chain, and the worker sees the
    request."""
    lease = engine.claim(noter.id, worker="w1")
    errors: list[BaseException] = []

    def operator_writes() -> None:
        try:
            run_terminate(run_id=noter.id, actor=Actor.for_user(operator, "web"), reason="stop")
        except BaseException as exc:
            errors.append(exc)
        finally:
            close_connection()

    with lease.checkpoint() as cp:
        cp.event("run.note", text="the worker's")
        cp.update(steps_used=1)
        # while the worker's commit is being built, holding no lock
        thread = threading.Thread(target=operator_writes)
        thread.start()
        thread.join(timeout=30)

    assert errors == []
    chain = assert_intact(noter.id)
    assert [e.type for e in chain[-2:]] == ["run.terminate_requested", "run.note"]
    run = Run.objects.get(id=noter.id)
    assert (run.steps_used, run.fence, run.requested_action) == (1, lease.fence, "terminate")
    # the worker knows where the record ends now, and what the operator asked
    assert (lease.run.event_seq, lease.run.last_event_hash) == (run.event_seq, run.last_event_hash)
    assert lease.run.requested_action == Run.Request.TERMINATE


@postgresql_only
@pytest.mark.django_db(transaction=True)
def test_a_write_without_lock_reads_back_a_budget_raised_meanwhile(noter):
    lease = engine.claim(noter.id, worker="w1")
    with lease.checkpoint() as cp:
        cp.event("run.note", text="the worker's")
        # an operator raised the budget without an event of its own
        thread = threading.Thread(
            target=lambda: (
                Run.objects.filter(id=noter.id).update(max_steps=99),
                close_connection(),
            )
        )
        thread.start()
        thread.join(timeout=30)

    assert lease.run.max_steps == 99
    assert_intact(noter.id)


@pytest.mark.django_db(transaction=True)
def test_a_zombies_write_without_lock_writes_nothing(noter):
    zombie = engine.claim(noter.id, worker="w1")
    expire_lease(noter.id)
    assert engine.claim(noter.id, worker="w2") is not None
    before = list(RunEvent.objects.filter(run_id=noter.id).values_list("seq", "type"))

    with pytest.raises(LeaseLost), zombie.checkpoint() as cp:
        cp.insert(Step(run_id=noter.id, seq=1, kind=Step.Kind.WAIT, incarnation=zombie.fence))
        cp.event("step.decided", seq=1)
        cp.update(steps_used=5)

    assert list(RunEvent.objects.filter(run_id=noter.id).values_list("seq", "type")) == before
    assert not Step.objects.filter(run_id=noter.id).exists()
    assert Run.objects.get(id=noter.id).steps_used == 0


@postgresql_only
@pytest.mark.django_db(transaction=True)
def test_a_body_locks_the_run_at_its_first_read_and_reads_what_it_collected(noter):
    """The caller chooses nothing: a lease holder's body that reads locks the run there (an
    operator waits for the commit), and the rows it collected before are already written."""
    lease = engine.claim(noter.id, worker="w1")
    seen: list[str] = []

    def operator_tries_to_lock():
        try:
            with transaction.atomic():
                Run.objects.select_for_update(nowait=True).filter(id=noter.id).exists()
            seen.append("free")
        except DatabaseError:
            seen.append("locked")
        finally:
            close_connection()

    with lease.checkpoint() as cp:
        cp.insert(Step(run_id=noter.id, seq=1, kind=Step.Kind.WAIT, incarnation=lease.fence))
        cp.event("step.decided", seq=1)
        probe = threading.Thread(target=operator_tries_to_lock)
        probe.start()
        probe.join(timeout=30)
        assert seen == ["free"]  # only collected so far: nothing is locked
        assert Step.objects.filter(run_id=noter.id, seq=1).exists()  # the read
        probe = threading.Thread(target=operator_tries_to_lock)
        probe.start()
        probe.join(timeout=30)
        assert seen == ["free", "locked"]

    assert [e.type for e in assert_intact(noter.id)][-1] == "step.decided"


@pytest.mark.django_db(transaction=True)
def test_what_a_body_asks_to_run_after_the_commit_runs_only_once_it_landed(noter):
    lease = engine.claim(noter.id, worker="w1")
    ran: list[int] = []
    with lease.checkpoint() as cp:
        cp.event("run.note", text="kept")
        cp.on_commit(lambda: ran.append(RunEvent.objects.filter(run_id=noter.id).count()))
        assert ran == []
    assert ran == [RunEvent.objects.filter(run_id=noter.id).count()]

    with pytest.raises(ValueError), lease.checkpoint() as cp:
        cp.event("run.note", text="rolled back")
        cp.on_commit(lambda: ran.append(-1))
        raise ValueError("the body failed")
    assert -1 not in ran


@postgresql_only
@pytest.mark.django_db(transaction=True)
def test_a_body_may_not_open_a_transaction_before_the_run_is_locked(noter):
    lease = engine.claim(noter.id, worker="w1")
    before = RunEvent.objects.filter(run_id=noter.id).count()

    with pytest.raises(RuntimeError, match="locked first"), lease.checkpoint() as cp:
        cp.event("run.note", text="never written")
        with transaction.atomic():
            Step.objects.filter(run_id=noter.id).exists()

    assert RunEvent.objects.filter(run_id=noter.id).count() == before


# --- append-only ------------------------------------------------------------------------------


@pytest.fixture
def recorded_event(system_actor) -> RunEvent:
    run = run_create(
        agent_name="refund",
        input={"order_id": "ord_1001", "amount_cents": 500},
        actor=system_actor,
    )
    return RunEvent.objects.get(run=run, seq=1)


@pytest.mark.django_db
def test_event_cannot_be_changed_through_the_orm(recorded_event):
    recorded_event.actor = "user:mallory"
    with pytest.raises(AppendOnlyError):
        recorded_event.save()
    with pytest.raises(AppendOnlyError):
        RunEvent.objects.filter(id=recorded_event.id).update(actor="user:mallory")
    with pytest.raises(AppendOnlyError), transaction.atomic():
        RunEvent.objects.bulk_update([recorded_event], ["actor"])

    assert RunEvent.objects.get(id=recorded_event.id).actor == "system"


@pytest.mark.django_db
def test_event_cannot_be_deleted_through_the_orm(recorded_event):
    with pytest.raises(AppendOnlyError):
        recorded_event.delete()
    with pytest.raises(AppendOnlyError):
        RunEvent.objects.filter(id=recorded_event.id).delete()
    with pytest.raises(AppendOnlyError):
        recorded_event.run.events.all().delete()

    assert RunEvent.objects.filter(id=recorded_event.id).exists()
    assert_intact(recorded_event.run_id)

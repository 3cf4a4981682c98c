"""A remote agent's request retried after its first attempt committed but its answer was lost:
propose (automatically), steps and waits (with ``seq``) answer with what the first attempt
recorded, and record nothing twice."""

from __future__ import annotations

import pytest

from runs.actors import Actor
from runs.models import Run, Signal, Step, ToolCall
from runs.waits import run_signal
from tests.api.conftest import assert_error
from tests.api.remote_support import Agent
from tests.support import expire_lease

pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("roles")]


def _seq(run: Run) -> int:
    return Run.objects.get(id=run.id).event_seq


# --- propose ------------------------------------------------------------------------------------


def test_retried_propose_gets_the_same_call(run, leased):
    first = leased.propose("refund", {"order_id": "ord_1", "amount_cents": 500})
    assert first.status_code == 201, first.content
    seq = _seq(run)

    again = leased.propose("refund", {"amount_cents": 500, "order_id": "ord_1"})

    assert again.status_code == 200, again.content
    assert again.json() == first.json()
    assert ToolCall.objects.filter(run=run).count() == 1
    assert Step.objects.filter(run=run).count() == 1
    assert Run.objects.get(id=run.id).steps_used == 1
    assert _seq(run) == seq  # nothing recorded
    call_id = again.json()["tool_call"]["id"]
    assert leased.dispatch(call_id).json()["go"] is True


def test_retried_propose_that_waits_for_an_approval_gets_the_same_approval(run, leased):
    first = leased.propose("refund", {"order_id": "ord_1", "amount_cents": 50000})
    assert first.json()["decision"] == "awaiting_approval"
    assert Run.objects.get(id=run.id).status == Run.Status.WAITING_APPROVAL  # lease released

    again = leased.propose("refund", {"order_id": "ord_1", "amount_cents": 50000})

    assert again.status_code == 200, again.content
    assert again.json()["decision"] == "awaiting_approval"
    assert again.json()["approval"] == first.json()["approval"] is not None
    assert ToolCall.objects.filter(run=run).count() == 1


def test_another_call_while_one_is_open_is_invalid_state(run, leased):
    leased.propose("refund", {"order_id": "ord_1", "amount_cents": 500})

    different = leased.propose("refund", {"order_id": "ord_1", "amount_cents": 600})

    assert_error(different, 409, "invalid_state")
    assert ToolCall.objects.filter(run=run).count() == 1


def test_same_call_after_it_was_dispatched_is_invalid_state(run, leased):
    call_id = leased.propose("lookup", {}).json()["tool_call"]["id"]
    leased.dispatch(call_id)

    assert_error(leased.propose("lookup", {}), 409, "invalid_state")


def test_propose_retried_by_a_stale_fence_is_lease_lost(run, leased):
    leased.propose("lookup", {})
    stale = leased.fence
    expire_lease(run.id)
    assert Agent(leased.client, run.id).lease().status_code == 200
    leased.fence = stale

    assert_error(leased.propose("lookup", {}), 409, "lease_lost")


# --- steps --------------------------------------------------------------------------------------


def test_step_retried_with_its_seq_is_recorded_once(run, leased):
    body = {"seq": 1, "input": {"prompt": "p"}, "output": {"plan": "refund"}, "tokens": 10}
    first = leased.run_post("steps", body)
    assert first.status_code == 201, first.content
    seq = _seq(run)

    again = leased.run_post("steps", body)

    assert again.status_code == 200, again.content
    assert again.json() == first.json()
    assert Step.objects.filter(run=run).count() == 1
    assert Run.objects.get(id=run.id).tokens_used == 10
    assert _seq(run) == seq


def test_step_with_a_taken_or_skipped_seq_is_invalid_state(run, leased):
    leased.run_post("steps", {"seq": 1, "output": "a"})

    assert_error(leased.run_post("steps", {"seq": 1, "output": "b"}), 409, "invalid_state")
    assert_error(leased.run_post("steps", {"seq": 3, "output": "b"}), 409, "invalid_state")
    assert leased.run_post("steps", {"seq": 2, "output": "b"}).status_code == 201


def test_steps_without_seq_are_each_recorded(run, leased):
    leased.run_post("steps", {"output": "poll"})
    leased.run_post("steps", {"output": "poll"})
    assert Step.objects.filter(run=run).count() == 2


# --- waits --------------------------------------------------------------------------------------


def test_wait_retried_with_its_seq_after_it_parked_gets_the_same_wait(run, leased):
    body = {"seq": 1, "kind": "signal", "name": "go", "timeout_seconds": 60}
    first = leased.run_post("waits", body)
    assert first.status_code == 201 and first.json()["waiting"] is True
    seq = _seq(run)

    again = leased.run_post("waits", body)  # the lease is released, the answer is repeated

    assert again.status_code == 200, again.content
    assert again.json() == first.json()
    assert Step.objects.filter(run=run).count() == 1 and _seq(run) == seq


def test_wait_retried_with_its_seq_after_it_ended_consumes_one_signal(run, leased, operator):
    for key in ("a", "b"):
        run_signal(
            run_id=run.id,
            name="go",
            payload={"key": key},
            idempotency_key=key,
            actor=Actor.for_user(operator, "api"),
        )
    body = {"seq": 1, "kind": "signal", "name": "go"}
    first = leased.run_post("waits", body)
    assert first.json()["waiting"] is False and first.json()["output"] == {"key": "a"}

    again = leased.run_post("waits", body)

    assert again.status_code == 200 and again.json()["output"] == {"key": "a"}
    assert Signal.objects.filter(run=run, consumed_at__isnull=True).count() == 1
    # a wait of another kind at that seq is not a retry of it
    assert_error(
        leased.run_post("waits", {"seq": 1, "kind": "timer", "seconds": 1}), 409, "invalid_state"
    )

from __future__ import annotations

import pytest

from runs.models import Run, RunEvent
from runs.services import run_create
from tests.conftest import drive


@pytest.mark.django_db
def test_small_refund_runs_to_success_with_one_refund(sandbox, system_actor):
    run = run_create(
        agent_name="refund", input={"order_id": "ord_1001", "amount_cents": 500}, actor=system_actor
    )
    run = drive(run.id)
    assert run.status == Run.Status.SUCCEEDED
    assert run.result["refunded"] is True
    import httpx

    refunds = httpx.get(f"{sandbox.url}/refunds/all").json()["refunds"]
    assert [r["idempotency_key"] for r in refunds] == [f"{run.id}:2"]
    seqs = list(RunEvent.objects.filter(run=run).values_list("seq", flat=True))
    assert seqs == list(range(1, len(seqs) + 1))

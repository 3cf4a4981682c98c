"""Dry runs through the MCP gateway (issue 23 item 5): a ``tools/call`` with
``_meta["agentops/dry_run"]`` goes into a dry run of the gateway — workers call the tool's
``dry_run``, nothing reaches the sandbox — and never into a real run, nor the other way."""

from __future__ import annotations

import pytest
from django.db import transaction

from agentops.mcp import selectors, services
from runs.actors import Actor
from runs.services import InvalidState
from runs.tokens import api_token_create
from tests.conftest import drive
from tests.support import refund_posts

pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("roles")]

REFUND = {"order_id": "ord_1002", "amount_cents": 700}


@pytest.fixture
def token(robot):
    made, _ = api_token_create(name="mcp", principal=robot, actor=Actor.system("cli"))
    return made


def _record(token, **kwargs):
    return services.gateway_call_record(
        token=token,
        tool_name="refund_payment",
        arguments=dict(REFUND),
        session="s1",
        **kwargs,
    )


def test_a_dry_run_call_is_simulated_and_sends_nothing(sandbox, token):
    call = _record(token, dry_run=True, client_key="refund-1")
    assert call.run.dry_run is True

    drive(call.run_id)

    outcome = selectors.gateway_call_outcome(call_id=call.id)
    assert outcome.status == selectors.SUCCEEDED
    assert outcome.result["dry_run"] is True and outcome.result["refund_id"] is None
    assert outcome.handle["dry_run"] is True and outcome.handle["source"] == "simulated"
    assert refund_posts(sandbox) == []

    # the same session's real calls go into a real run of their own
    real = _record(token, client_key="refund-2")
    assert real.run_id != call.run_id and real.run.dry_run is False
    assert "dry_run" not in selectors.gateway_call_outcome(call_id=real.id).handle


def test_a_call_never_crosses_between_a_dry_run_and_a_real_one(sandbox, token):
    dry = _record(token, dry_run=True, client_key="refund-1")

    with pytest.raises(InvalidState, match="is a dry run"), transaction.atomic():
        _record(token, run_id=str(dry.run_id), client_key="refund-3")
    with pytest.raises(services.KeyReused), transaction.atomic():
        _record(token, client_key="refund-1")  # the dry run's key, asked for real

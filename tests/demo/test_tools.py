"""The demo tools over ``runs.toolhttp``: the key, the fence and the send deadline reach the
sandbox as headers, the timeout bounds the whole call, nothing leaves after the send
deadline, and what each tool declares its downstream honours follows the settings."""

from __future__ import annotations

import importlib
import time
from datetime import UTC, datetime, timedelta

import httpx
import pytest
from django.test import override_settings

from agentops.demo import tools
from runs.registry import OutcomeUnknown, Resend, SendDeadlinePassed, ToolContext
from tests.support import refund_posts, refunds, set_faults

REFUND = {"order_id": "ord_1002", "amount_cents": 700}


def _ctx(*, timeout: float = 2.0, send_in: float = 5.0, key: str = "run-1:2") -> ToolContext:
    now = time.monotonic()
    return ToolContext(
        run_id="run-1",
        idempotency_key=key,
        attempt=1,
        timeout=timeout,
        fence=4,
        send_deadline=datetime.now(UTC) + timedelta(seconds=send_in),
        send_by=now + send_in,
        finish_by=now + timeout,
    )


def test_a_refund_carries_the_key_the_fence_and_the_send_deadline(sandbox):
    ctx = _ctx()
    result = tools.refund_payment(REFUND, ctx)

    (post,) = refund_posts(sandbox)
    assert post["idempotency_key"] == "run-1:2"
    assert post["fence"] == "4"
    assert datetime.fromisoformat(post["send_deadline"]) == ctx.send_deadline
    assert post["late"] is False
    assert result.external_ref == refunds(sandbox)[0]["refund_id"]


def test_nothing_leaves_after_the_send_deadline(sandbox):
    ctx = _ctx(send_in=-0.1)
    with pytest.raises(SendDeadlinePassed):
        tools.refund_payment(REFUND, ctx)
    assert refund_posts(sandbox) == []


def test_the_timeout_bounds_the_whole_call(sandbox):
    set_faults(sandbox, latency_ms=3000)
    started = time.monotonic()
    with pytest.raises(OutcomeUnknown, match="timed out"):
        tools.refund_payment(REFUND, _ctx(timeout=0.8))
    assert time.monotonic() - started < 1.5


def test_a_downstream_refusal_of_a_late_request_is_send_deadline_passed(sandbox):
    httpx.post(f"{sandbox.url}/mode", json={"deadline": True}, timeout=5).raise_for_status()
    # the local clock still allows it, the sandbox's deadline has passed: as a clock skew
    # or a pause after the last local check would look from the downstream
    now = time.monotonic()
    ctx = ToolContext(
        run_id="run-1",
        idempotency_key="run-1:2",
        attempt=1,
        timeout=2.0,
        fence=4,
        send_deadline=datetime.now(UTC) - timedelta(seconds=1),
        send_by=now + 5,
        finish_by=now + 2,
    )
    with pytest.raises(SendDeadlinePassed, match="refused it as received late"):
        tools.refund_payment(REFUND, ctx)
    assert refunds(sandbox) == []
    (post,) = refund_posts(sandbox)
    assert post["late"] is True and post["refused"] is True


@pytest.fixture
def rebuilt_tools():
    """Builds the tools again under the settings a test sets, and puts them back after."""
    yield lambda: importlib.reload(tools)
    importlib.reload(tools)


@pytest.mark.parametrize(
    ("honours", "key", "deadline"),
    [([], False, False), (["key"], True, False), (["deadline"], False, True)],
)
def test_the_refund_tool_declares_what_the_sandbox_is_configured_to_honour(
    settings, rebuilt_tools, honours, key, deadline
):
    version = tools.REFUND_PAYMENT.version
    with override_settings(AGENTOPS={**settings.AGENTOPS, "SANDBOX_HONOURS": honours}):
        module = rebuilt_tools()
    assert module.REFUND_PAYMENT.honours_key is key
    assert module.REFUND_PAYMENT.honours_deadline is deadline
    assert module.SEND_NOTIFICATION.honours_key is False
    assert module.SEND_NOTIFICATION.honours_deadline is deadline
    assert module.REFUND_PAYMENT.resend == Resend.AUTO
    # the contract-ish names and schemas do not change with the declaration
    assert module.REFUND_PAYMENT.version == version


def test_resend_person_is_configurable(settings, rebuilt_tools):
    with override_settings(AGENTOPS={**settings.AGENTOPS, "SANDBOX_RESEND": "person"}):
        module = rebuilt_tools()
    assert module.REFUND_PAYMENT.resend == Resend.PERSON

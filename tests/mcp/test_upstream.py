"""Tools proxied from an upstream MCP server (``AGENTOPS_MCP_UPSTREAMS``): declared effect
class and approval policy, the call made by the engine with its key in ``_meta``, the
upstream's own ledger counting what it received."""

from __future__ import annotations

import pytest
from django.core.exceptions import ImproperlyConfigured

from agentops.mcp import selectors, services, upstream
from approvals.models import Approval
from approvals.services import approval_decide
from runs.actors import Actor
from runs.models import Run, ToolCall
from runs.tokens import api_token_create
from tests.conftest import drive

pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("roles")]


@pytest.fixture
def token(robot):
    made, _ = api_token_create(name="mcp", principal=robot, actor=Actor.system("cli"))
    return made


def call(token, tool: str, arguments: dict, key: str = "") -> selectors.Outcome:
    recorded = services.gateway_call_record(
        token=token, tool_name=tool, arguments=arguments, client_key=key, session="s"
    )
    drive(recorded.run_id)
    return selectors.gateway_call_outcome(call_id=recorded.id)


def test_an_upstream_tool_is_called_by_the_engine_with_the_calls_key(register, upstream, token):
    register(*upstream.tools_for_test())
    assert "notes.add_note" in {t.name for t in services.tools_for(token.principal)}

    answer = call(token, "notes.add_note", {"text": "hello"}, key="n1")
    assert answer.status == selectors.SUCCEEDED and answer.result == {"note": 1}
    made = ToolCall.objects.get(tool_name="notes.add_note")
    assert upstream.ledger == [{"text": "hello", "key": made.idempotency_key}]
    # the same key again: the recorded outcome, the upstream is not called again
    assert call(token, "notes.add_note", {"text": "hello"}, key="n1").result == {"note": 1}
    assert len(upstream.ledger) == 1


def test_an_upstream_tool_declared_gated_waits_for_an_approver(register, upstream, token, approver):
    register(*upstream.tools_for_test(approval="always"))
    assert call(token, "notes.add_note", {"text": "x"}, key="g").status == (
        selectors.AWAITING_APPROVAL
    )
    assert upstream.ledger == []
    approval_decide(
        approval_id=Approval.objects.get().id,
        decision="approve",
        actor=Actor.for_user(approver, "web"),
    )
    assert call(token, "notes.add_note", {"text": "x"}, key="g").status == selectors.SUCCEEDED
    assert len(upstream.ledger) == 1


def test_an_upstream_error_is_a_failed_call_and_its_silence_an_unknown_one(
    register, upstream, token
):
    register(*upstream.tools_for_test())
    failed = call(token, "notes.broken", {})
    assert failed.status == selectors.FAILED and "disk full" in failed.error

    upstream.stop()
    lost = call(token, "notes.add_note", {"text": "y"})
    # unsafe: nobody knows whether it happened, so it waits for a person, never re-sent
    assert lost.status == selectors.PENDING
    assert ToolCall.objects.get(arguments={"text": "y"}).status == ToolCall.Status.UNKNOWN
    assert Run.objects.get(id=lost.handle["run_id"]).status == Run.Status.NEEDS_ATTENTION


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ("[1]", "an object of upstream servers"),
        ('{"a b": {}}', "a name of letters"),
        ('{"u": {"url": "ftp://x", "tools": {"t": {"effect": "read"}}}}', "needs an http"),
        ('{"u": {"url": "http://x", "tools": {"t": {"effect": "reconcilable"}}}}', "effect"),
        (
            '{"u": {"url": "http://x", "tools": {"t": {"effect": "read", "approval": "maybe"}}}}',
            "approval",
        ),
    ],
)
def test_a_bad_upstream_declaration_stops_the_process_with_its_reason(config, message):
    with pytest.raises(ImproperlyConfigured, match=message):
        upstream.parse(config)

"""The gateway's record, in-process: what ``tools/call`` records, which key finds a call
again, who may call what, and the ``mcp-gateway`` agent driven by the real engine."""

from __future__ import annotations

import time

import pytest

from agentops.mcp import selectors, services
from agentops.mcp.gateway import AGENT_NAME
from agentops.mcp.models import GatewayCall
from approvals.models import Approval
from approvals.services import approval_decide
from runs.actors import Actor, PermissionDenied
from runs.models import Run, ToolCall
from runs.registry import Effect, Tool
from runs.services import InvalidInput, run_create, run_terminate
from runs.timeline import describe
from runs.tokens import api_token_create
from tests.conftest import drive
from tests.support import CountingTool, event_types, refund_posts

pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("roles")]

ORDER = {"order_id": "ord_1004"}
LARGE = {"order_id": "ord_1004", "amount_cents": 20_000}


@pytest.fixture
def token(robot):
    made, _ = api_token_create(name="mcp", principal=robot, actor=Actor.system("cli"))
    return made


def record(token, tool="lookup_order", arguments=None, **kwargs) -> GatewayCall:
    return services.gateway_call_record(
        token=token,
        tool_name=tool,
        arguments=dict(ORDER if arguments is None else arguments),
        session=kwargs.pop("session", "s1"),
        **kwargs,
    )


def outcome(call: GatewayCall) -> selectors.Outcome:
    return selectors.gateway_call_outcome(call_id=call.id)


def test_the_gateway_run_takes_each_recorded_call_in_turn_and_waits_between(sandbox, token):
    first = record(token)
    run = first.run
    assert (run.agent_name, run.principal_id) == (AGENT_NAME, token.principal_id)
    assert outcome(first).status == selectors.PENDING

    assert drive(run.id).status == Run.Status.WAITING_EVENT
    done = outcome(first)
    assert done.status == selectors.SUCCEEDED and done.result["order_id"] == "ord_1004"

    second = record(token, arguments={"order_id": "ord_1002"})
    assert (second.run_id, second.position) == (run.id, 2)
    assert Run.objects.get(id=run.id).status in Run.RUNNABLE  # woken by the call
    drive(run.id)
    assert outcome(second).result["order_id"] == "ord_1002"
    assert list(
        ToolCall.objects.filter(run=run).order_by("step__seq").values_list("status", flat=True)
    ) == ["succeeded", "succeeded"]
    received = [e for e in run.events.order_by("seq") if e.type == "mcp.call_received"]
    assert [e.payload["position"] for e in received] == [1, 2]
    assert "MCP call #1 → lookup_order" in describe(
        received[0].type, received[0].payload, received[0].actor
    )


def test_the_same_arguments_in_a_run_are_the_same_call(sandbox, token):
    first = record(token)
    drive(first.run_id)
    again = record(token)
    assert again.id == first.id
    drive(first.run_id)
    assert ToolCall.objects.count() == 1
    assert event_types(first.run_id).count("mcp.call_received") == 1


def test_a_client_key_finds_its_call_from_another_session(sandbox, token, approver):
    first = record(token, "refund_payment", LARGE, client_key="refund-1", session="s1")
    drive(first.run_id)
    assert outcome(first).status == selectors.AWAITING_APPROVAL
    # the client reconnected (a new session): the key, not the session, finds the call
    again = record(token, "refund_payment", LARGE, client_key="refund-1", session="s2")
    assert again.id == first.id
    approval = Approval.objects.get()
    approval_decide(
        approval_id=approval.id, decision="approve", actor=Actor.for_user(approver, "web")
    )
    drive(first.run_id)
    assert outcome(again).status == selectors.SUCCEEDED
    assert len(refund_posts(sandbox)) == 1


def test_a_client_key_reused_for_other_arguments_is_refused(sandbox, token):
    record(token, client_key="k")
    with pytest.raises(services.KeyReused):
        record(token, arguments={"order_id": "ord_1002"}, client_key="k")
    assert GatewayCall.objects.count() == 1


def test_arguments_off_the_schema_are_refused_before_anything_is_recorded(token):
    with pytest.raises(InvalidInput, match="order_id"):
        record(token, arguments={"order_id": 7})
    assert not GatewayCall.objects.exists() and not Run.objects.exists()


def test_only_tools_of_the_principals_groups_are_offered(register, token):
    register(
        Tool(
            name="payroll_read",
            effect=Effect.READ,
            call=CountingTool(),
            allowed_groups=("finance",),
        )
    )
    assert "payroll_read" not in {tool.name for tool in services.tools_for(token.principal)}
    assert "lookup_order" in {tool.name for tool in services.tools_for(token.principal)}
    with pytest.raises(services.ToolNotOffered):
        record(token, "payroll_read", {})


def test_only_the_agent_role_uses_the_gateway(operator):
    made, _ = api_token_create(name="op", principal=operator, actor=Actor.system("cli"))
    with pytest.raises(PermissionDenied):
        record(made)
    assert not Run.objects.exists()


def test_a_call_its_run_never_took_is_recorded_again_in_a_new_run(sandbox, token, operator):
    lost = record(token, client_key="k")
    run_terminate(run_id=lost.run_id, actor=Actor.for_user(operator, "web"), reason="test")
    assert outcome(lost).status == selectors.FAILED

    again = record(token, client_key="k")
    assert again.run_id != lost.run_id
    drive(again.run_id)
    assert outcome(again).status == selectors.SUCCEEDED
    assert GatewayCall.objects.count() == 1


def test_a_run_id_names_only_a_live_gateway_run_of_the_principal(sandbox, token, robot):
    first = record(token)
    same = record(token, arguments={"order_id": "ord_1002"}, run_id=str(first.run_id))
    assert same.run_id == first.run_id
    other_run = run_create(
        agent_name="refund",
        input={"order_id": "ord_1003", "amount_cents": 100},
        actor=Actor.system("cli"),
        principal=robot,
    )
    for run_id in (str(other_run.id), "not-a-uuid"):
        with pytest.raises(services.RunNotFound):
            record(token, arguments={"order_id": "ord_1003"}, run_id=run_id)


def test_an_idle_gateway_run_finishes_and_the_next_call_starts_another(
    sandbox, token, settings, monkeypatch
):
    monkeypatch.setitem(settings.AGENTOPS_MCP, "IDLE_SECONDS", 0.05)
    first = record(token)
    drive(first.run_id)
    time.sleep(0.1)
    finished = drive(first.run_id)
    assert finished.status == Run.Status.SUCCEEDED
    assert finished.result == {"calls": 1}

    later = record(token)
    assert later.run_id != first.run_id
    drive(later.run_id)
    assert outcome(later).status == selectors.SUCCEEDED
    # the finished run's call still answers its own outcome
    assert outcome(first).status == selectors.SUCCEEDED


def test_a_rejected_approval_answers_failed_and_nothing_is_sent(sandbox, token, approver):
    call = record(token, "refund_payment", LARGE, client_key="big")
    drive(call.run_id)
    approval_decide(
        approval_id=Approval.objects.get().id,
        decision="reject",
        actor=Actor.for_user(approver, "web"),
    )
    drive(call.run_id)
    answer = outcome(record(token, "refund_payment", LARGE, client_key="big"))
    assert answer.status == selectors.FAILED and "rejected" in answer.error
    assert refund_posts(sandbox) == []
    # the run goes on taking calls
    assert Run.objects.get(id=call.run_id).status == Run.Status.WAITING_EVENT

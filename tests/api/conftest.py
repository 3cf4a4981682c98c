"""API fixtures: bearer-token clients for users in roles, and test agents that park a run
where each endpoint has something to act on (no sandbox needed)."""

from __future__ import annotations

import pytest
from rest_framework.test import APIClient

from runs.actors import Actor
from runs.models import Run
from runs.registry import ApprovalPolicy, CallTool, Effect, Finish, OutcomeUnknown
from runs.services import run_create
from runs.tokens import api_token_create
from tests.conftest import drive
from tests.support import CountingTool, ScriptedAgent, make_tool

pytestmark = pytest.mark.usefixtures("roles")

PAY_SCHEMA = {
    "type": "object",
    "properties": {"amount_cents": {"type": "integer", "minimum": 1}, "card": {"type": "string"}},
    "required": ["amount_cents"],
    "additionalProperties": False,
}


@pytest.fixture
def admin(django_user_model):
    """A superuser: may register remote agents' manifests (test_agents.py has its own: a
    member of the admin group)."""
    return django_user_model.objects.create_superuser("root", password="x")


def token_for(user, name: str | None = None) -> str:
    _, raw = api_token_create(
        name=name or f"token-{user.username}", principal=user, actor=Actor.system("cli")
    )
    return raw


def client_for(user) -> APIClient:
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {token_for(user)}")
    return client


@pytest.fixture
def as_operator(roles, operator) -> APIClient:
    return client_for(operator)


@pytest.fixture
def as_viewer(roles, viewer) -> APIClient:
    return client_for(viewer)


@pytest.fixture
def as_robot(roles, robot) -> APIClient:
    return client_for(robot)


@pytest.fixture
def as_approver(roles, approver) -> APIClient:
    return client_for(approver)


@pytest.fixture
def anonymous() -> APIClient:
    return APIClient()


@pytest.fixture
def api_agents(register):
    """``api_pay``: pays after an approval, then finishes. ``api_send``: an unsafe send whose
    outcome is always unknown (so the run needs attention)."""
    pay = CountingTool()
    send = CountingTool(lambda arguments, ctx: (_ for _ in ()).throw(OutcomeUnknown("reset")))

    def pay_decide(ctx):
        if not ctx.steps:
            return CallTool(
                "api_pay", {"amount_cents": ctx.input["amount_cents"], "card": "4242-4242-SECRET"}
            )
        return Finish({"paid": ctx.last_step.status})

    def read_then_pay_decide(ctx):
        if not ctx.steps:
            return CallTool("api_read", {})
        if len(ctx.steps) == 1:
            return CallTool("api_pay", {"amount_cents": 7, "card": "4242-4242-SECRET"})
        return Finish({"paid": ctx.last_step.status})

    def send_decide(ctx):
        if not ctx.steps:
            return CallTool("api_send", {})
        return Finish({"sent": ctx.last_step.status})

    pay_tool = make_tool(
        "api_pay",
        pay,
        effect=Effect.IDEMPOTENT,
        schema=PAY_SCHEMA,
        approval=ApprovalPolicy(when="always", group="approver"),
    )
    pay_tool.sensitive_fields = ("card",)
    register(
        pay_tool,
        make_tool("api_send", send, effect=Effect.UNSAFE),
        make_tool("api_read", CountingTool(), effect=Effect.READ),
        ScriptedAgent("api_reader", read_then_pay_decide, tools=("api_read", "api_pay")),
        ScriptedAgent(
            "api_payer",
            pay_decide,
            tools=("api_pay",),
            input_schema={
                "type": "object",
                "properties": {"amount_cents": {"type": "integer", "minimum": 1}},
                "required": ["amount_cents"],
            },
        ),
        ScriptedAgent("api_sender", send_decide, tools=("api_send",)),
    )
    return pay, send


def start(agent: str = "api_payer", **input) -> Run:
    if agent == "api_payer" and not input:
        input = {"amount_cents": 500}
    return run_create(agent_name=agent, input=input, actor=Actor.system("cli"))


@pytest.fixture
def waiting_run(api_agents) -> Run:
    """A run parked waiting for an approval of its ``api_pay`` call."""
    run = drive(start().id)
    assert run.status == Run.Status.WAITING_APPROVAL
    return run


@pytest.fixture
def attention_run(api_agents) -> Run:
    """A run needing attention: its unsafe call's outcome is unknown."""
    run = drive(start("api_sender").id)
    assert run.status == Run.Status.NEEDS_ATTENTION, run.status
    return run


def assert_error(response, status: int, code: str) -> dict:
    assert response.status_code == status, (response.status_code, response.content)
    body = response.json()
    assert body["code"] == code, body
    assert isinstance(body["detail"], str) and body["detail"]
    if code == "validation_error":
        assert isinstance(body["fields"], dict)
    else:
        assert "fields" not in body
    return body

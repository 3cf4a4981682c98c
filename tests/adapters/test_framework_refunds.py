"""Issue 27, item 3: a Pydantic AI agent (``FunctionModel``) and an OpenAI Agents SDK agent
(a scripted ``Model``), each a real process with a few lines of glue
(``agentops.client.pydantic_ai`` / ``agentops.client.openai_agents``), refund an order
through agentops against a live server and the sandbox in its non-deduplicating mode. The
sandbox's own ledger counts the refunds: one, whether the refund needed an approval or the
agent was SIGKILLed between the refund and its receipt."""

from __future__ import annotations

import pytest

from agentops.client import Client
from runs.actors import Actor
from runs.models import Run, RunMessage, Step, ToolCall, ToolReceipt
from runs.services import run_create
from tests.agentproc import AgentProcess
from tests.api.conftest import token_for
from tests.support import event_types, expire_lease, refund_posts, refunds

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("roles")]

FRAMEWORKS = {
    "pydantic_ai": "tests.adapters.pydantic_refunder",
    "openai_agents": "tests.adapters.openai_refunder",
}


@pytest.fixture(params=sorted(FRAMEWORKS))
def framework(request, register_refunder, live_server, sandbox, operator):
    name = f"{request.param}_refunder"
    token = register_refunder(name)

    class Framework:
        def start_run(self, order_id: str, amount_cents: int) -> Run:
            return run_create(
                agent_name=name,
                goal="refund a late order",
                input={"order_id": order_id, "amount_cents": amount_cents},
                actor=Actor.for_user(operator, "api"),
            )

        def agent(self, run: Run, **env: str) -> AgentProcess:
            return AgentProcess(
                FRAMEWORKS[request.param],
                live_server.url,
                str(run.id),
                token=token,
                sandbox_url=sandbox.url,
                **env,
            )

    return Framework()


def _one_refund(sandbox, run: Run) -> ToolCall:
    """The run's one call refunded once, and the agent's model saw the refund."""
    call = ToolCall.objects.get(run=run)
    assert refunds(sandbox)[0]["refund_id"] in str(run.result)
    assert [r["idempotency_key"] for r in refunds(sandbox)] == [call.idempotency_key]
    assert len(refund_posts(sandbox)) == 1  # the key was sent once
    # one decision checkpointed, and acted on by whichever process came next
    (decision,) = Step.objects.filter(run=run, kind=Step.Kind.DECISION)
    # the conversation is in the run's history store, each message stored once (a resumed
    # process appends nothing it read back), named by the checkpoint; the state is untouched
    named = [seq for first, last in decision.output["history"] for seq in range(first, last + 1)]
    stored = RunMessage.objects.filter(run=run).order_by("seq").values_list("seq", flat=True)
    assert named and list(stored) == named
    assert run.state == {}
    return call


def test_refund_below_the_threshold_goes_through_once(framework, sandbox):
    run = framework.start_run("ord_1002", 1500)
    agent = framework.agent(run)
    assert agent.finish() == 0, agent.seen
    assert agent.seen[-1].startswith("finished"), agent.seen

    run.refresh_from_db()
    assert run.status == Run.Status.SUCCEEDED, run.reason
    call = _one_refund(sandbox, run)
    assert (call.status, call.attempt_count) == (ToolCall.Status.SUCCEEDED, 1)
    assert ToolReceipt.objects.get(tool_call=call).source == "agent"


def test_refund_above_the_threshold_waits_for_an_approval(
    framework, sandbox, live_server, approver
):
    run = framework.start_run("ord_1006", 15000)
    first = framework.agent(run)
    assert first.finish() == 0, first.seen
    assert first.seen[-1] == "parked: waiting for approval", first.seen
    run.refresh_from_db()
    assert run.status == Run.Status.WAITING_APPROVAL
    assert refunds(sandbox) == []

    call = ToolCall.objects.get(run=run)
    assert call.status == ToolCall.Status.AWAITING_APPROVAL
    with Client(live_server.url, token_for(approver)) as people:
        pending = people.request("GET", "approvals/")["results"]
        assert [a["tool_call"] for a in pending] == [call.id]
        people.decide_approval(pending[0]["id"], "approve", comment="fine")

    second = framework.agent(run)
    assert second.finish() == 0, second.seen
    assert second.seen[-1].startswith("finished"), second.seen
    # resumed from the checkpointed decision: the model is asked only for its answer
    assert second.seen.count("model asked") == 1, second.seen
    run.refresh_from_db()
    assert run.status == Run.Status.SUCCEEDED, second.seen
    call = _one_refund(sandbox, run)
    assert (call.status, call.attempt_count) == (ToolCall.Status.SUCCEEDED, 1)


def test_agent_killed_between_refund_and_receipt_finds_it_by_lookup(framework, sandbox):
    run = framework.start_run("ord_1002", 1500)
    first = framework.agent(run, HOLD_AFTER_TOOL="1")
    try:
        key = first.wait_for("dispatching").split()[1]
        first.wait_for("tool returned 2")
    finally:
        first.kill()
    call = ToolCall.objects.get(run=run)
    assert call.status == ToolCall.Status.DISPATCHING
    assert len(refunds(sandbox)) == 1  # it happened; nothing recorded it
    expire_lease(run.id)  # the dead process's lease ran out (moved into the past, not slept)

    second = framework.agent(run)
    assert second.finish() == 0, second.seen
    assert f"reconciled {key}: found" in second.seen, second.seen
    assert not any(line.startswith("dispatching") for line in second.seen), second.seen
    assert second.seen.count("model asked") == 1, second.seen
    assert second.seen[-1].startswith("finished"), second.seen

    run.refresh_from_db()
    assert run.status == Run.Status.SUCCEEDED
    call = _one_refund(sandbox, run)
    assert (call.status, call.attempt_count) == (ToolCall.Status.SUCCEEDED, 1)
    assert ToolReceipt.objects.get(tool_call=call).source == "reconciliation"
    types = event_types(run.id)
    assert "tool.unknown" in types and types[-1] == "run.succeeded"


def test_agent_dead_after_the_receipt_answers_from_the_record(framework, sandbox):
    run = framework.start_run("ord_1002", 1500)
    first = framework.agent(run, DIE_BEFORE_ANSWER="1")
    assert first.finish() == 9, first.seen
    assert ToolCall.objects.get(run=run).status == ToolCall.Status.SUCCEEDED
    expire_lease(run.id)

    second = framework.agent(run)
    assert second.finish() == 0, second.seen
    # the recorded result goes back to the framework: nothing dispatched, nothing looked up
    assert not any(line.startswith(("dispatching", "reconciled")) for line in second.seen)
    assert second.seen.count("model asked") == 1, second.seen
    run.refresh_from_db()
    assert run.status == Run.Status.SUCCEEDED
    call = _one_refund(sandbox, run)
    assert (call.status, call.attempt_count) == (ToolCall.Status.SUCCEEDED, 1)


def test_rejected_refund_is_never_sent_and_the_model_hears_why(
    framework, sandbox, live_server, approver
):
    run = framework.start_run("ord_1006", 15000)
    first = framework.agent(run)
    assert first.finish() == 0, first.seen
    with Client(live_server.url, token_for(approver)) as people:
        pending = people.request("GET", "approvals/")["results"]
        people.decide_approval(pending[0]["id"], "reject", comment="too much")

    second = framework.agent(run)
    assert second.finish() == 0, second.seen
    assert second.seen[-1].startswith("finished"), second.seen
    assert second.seen.count("model asked") == 1, second.seen  # asked only for its answer
    run.refresh_from_db()
    assert run.status == Run.Status.SUCCEEDED
    assert "refund_payment refused: approval rejected: too much" in str(run.result), run.result
    assert refunds(sandbox) == [] and refund_posts(sandbox) == []
    assert ToolCall.objects.get(run=run).status == ToolCall.Status.REJECTED

"""LLM-backed agents (runs/llm.py) against a real fake OpenAI-compatible HTTP server: a whole
run, tokens and cost in the budgets, the pinned model, retries, postponement, condensed
history, and a worker killed right after a decision that resumes without asking the model
again."""

from __future__ import annotations

import dataclasses
import json
from decimal import Decimal
from io import StringIO

import pytest
from django.conf import settings
from django.core.management import CommandError, call_command
from django.db import transaction

from agentops.demo.llm_agents import LLMRefundAgent
from runs import faults
from runs.audit.run_chains import verify_run
from runs.llm import LLMAgent, LLMConfig, ModelCallInTransaction, tool_schema
from runs.models import Run, Step, ToolCall
from runs.registry import CallTool, Decision, DecisionContext, registry
from runs.services import run_create
from runs.timeline import describe
from tests.conftest import drive
from tests.runs.workerprocs import wait_for, worker_env
from tests.support import WorkerKilled, event_types, events, refund_posts, refunds, rewind
from tests.support_llm import (
    FakeOpenAI,
    Reply,
    error,
    refund_script,
    text,
    tool_call,
    tool_results,
)

INPUT = {"order_id": "ord_1002", "amount_cents": 700, "reason": "damaged"}


@pytest.fixture
def fake_llm(monkeypatch):
    servers: list[FakeOpenAI] = []

    def start(script=refund_script, **overrides):
        server = FakeOpenAI(script).start()
        servers.append(server)
        conf = {
            **settings.AGENTOPS_LLM,
            "BASE_URL": server.base_url,
            "API_KEY": "sk-test-key",
            "MODEL": "fake-model-2026",
            "BACKOFF": 0.01,
            "MAX_BACKOFF": 0.05,
            "INPUT_PRICE": Decimal("2.50"),
            "OUTPUT_PRICE": Decimal("10"),
            **overrides,
        }
        monkeypatch.setattr(settings, "AGENTOPS_LLM", conf)
        return server

    yield start
    for server in servers:
        server.stop()


@pytest.fixture
def llm_refund(register):
    return register(LLMRefundAgent())


@pytest.mark.django_db
@pytest.mark.usefixtures("llm_refund")
def test_an_llm_agent_completes_a_refund_through_the_model(fake_llm, sandbox, system_actor):
    server = fake_llm()
    run = run_create(agent_name="llm_refund", input=INPUT, actor=system_actor, max_tokens=10_000)

    run = drive(run.id)

    assert run.status == Run.Status.SUCCEEDED, run.reason_detail
    assert run.result["answer"].startswith("Refunded 700 cents: ")
    assert len(refunds(sandbox)) == 1
    assert server.request_count == 3
    # the model pinned at creation is the one asked, with the key, the tools and no more
    first = server.requests[0]
    assert run.model_id == "fake-model-2026"
    assert {r["model"] for r in server.requests} == {"fake-model-2026"}
    assert server.headers[0]["authorization"] == "Bearer sk-test-key"
    names = [t["function"]["name"] for t in first["tools"]]
    assert names == ["lookup_order", "refund_payment", "fail_run", "ask_person"]
    lookup = registry.tool("lookup_order")
    assert first["tools"][0]["function"]["parameters"] == lookup.schema
    assert first["parallel_tool_calls"] is False
    # the second decision saw the lookup's real outcome and the authoritative state last
    second = server.requests[1]["messages"]
    assert second[-2]["role"] == "tool"
    assert json.loads(second[-2]["content"])["call_status"] == "succeeded"
    assert second[-1]["content"].startswith("Authoritative state of this run")


@pytest.mark.django_db
@pytest.mark.usefixtures("llm_refund")
def test_tokens_and_cost_of_each_decision_are_recorded_on_its_step_and_the_run(
    fake_llm, sandbox, system_actor
):
    fake_llm()
    run = run_create(agent_name="llm_refund", input=INPUT, actor=system_actor)

    run = drive(run.id)

    steps = list(Step.objects.filter(run=run).order_by("seq"))
    assert [(s.kind, s.tokens) for s in steps] == [
        ("tool_call", 120),
        ("tool_call", 340),
        ("finish", 120),
    ]
    # 2.50 per million prompt tokens, 10 per million completion tokens
    assert steps[1].cost == Decimal("0.001150")
    assert run.tokens_used == 580
    assert run.cost_used == sum(s.cost for s in steps)
    decided = events(run.id, "step.decided")
    assert decided[1].payload["usage"]["prompt_tokens"] == 300
    assert decided[1].payload["usage"]["model"] == "fake-model-2026"
    # the usage joins the event in its commit: an auditor's check of the chain still holds
    assert verify_run(run) is None


@pytest.mark.django_db
@pytest.mark.usefixtures("llm_refund")
def test_a_token_budget_stops_the_run_before_the_model_is_asked_again(
    fake_llm, sandbox, system_actor
):
    server = fake_llm()
    run = run_create(agent_name="llm_refund", input=INPUT, actor=system_actor, max_tokens=400)

    run = drive(run.id)

    # 120 + 340 tokens used: over the budget before the third decision
    assert run.status == Run.Status.NEEDS_ATTENTION
    assert run.reason_code == Run.Reason.BUDGET_EXHAUSTED
    assert server.request_count == 2
    # and the model was never offered more completion tokens than the budget had left
    assert server.requests[1]["max_tokens"] == 400 - 120


@pytest.mark.django_db
@pytest.mark.usefixtures("llm_refund")
def test_the_pinned_model_survives_a_settings_change(fake_llm, sandbox, system_actor):
    server = fake_llm()
    run = run_create(agent_name="llm_refund", input=INPUT, actor=system_actor)
    settings.AGENTOPS_LLM["MODEL"] = "a-newer-model"

    drive(run.id)

    assert Run.objects.get(id=run.id).model_id == "fake-model-2026"
    assert {r["model"] for r in server.requests} == {"fake-model-2026"}


@pytest.mark.django_db
@pytest.mark.usefixtures("llm_refund")
def test_a_run_without_a_pinned_model_is_pinned_once_with_an_event(fake_llm, sandbox, system_actor):
    fake_llm()
    run = run_create(agent_name="llm_refund", input=INPUT, actor=system_actor)
    Run.objects.filter(id=run.id).update(model_id="")  # as if created before it used a model

    drive(run.id)

    assert Run.objects.get(id=run.id).model_id == "fake-model-2026"
    assert [e.payload["model"] for e in events(run.id, "run.model_pinned")] == ["fake-model-2026"]


@pytest.mark.django_db
@pytest.mark.usefixtures("llm_refund")
def test_429_and_503_are_retried_and_the_decision_then_succeeds(fake_llm, sandbox, system_actor):
    def flaky(request, index):
        if index == 0:
            return error(429, "slow down", retry_after="0")
        if index == 1:
            return error(503, "overloaded")
        return refund_script(request, index)

    server = fake_llm(flaky)
    run = run_create(agent_name="llm_refund", input=INPUT, actor=system_actor)

    run = drive(run.id)

    assert run.status == Run.Status.SUCCEEDED, run.reason_detail
    assert server.request_count == 5  # two refusals, then three decisions
    assert len(refunds(sandbox)) == 1
    # the retries are part of the first decision's record
    assert events(run.id, "step.decided")[0].payload["usage"]["requests"] == 3


@pytest.mark.django_db
@pytest.mark.usefixtures("llm_refund")
def test_a_model_api_that_stays_down_postpones_the_run_instead_of_failing_it(
    fake_llm, sandbox, system_actor
):
    server = fake_llm(lambda request, index: error(500), MAX_RETRIES=2, POSTPONE=120)
    run = run_create(agent_name="llm_refund", input=INPUT, actor=system_actor)

    run = drive(run.id)

    assert server.request_count == 3  # the first attempt and two retries
    assert run.status == Run.Status.QUEUED
    assert run.wake_at is not None
    assert Step.objects.filter(run=run).count() == 0
    postponed = events(run.id, "agent.postponed")
    assert len(postponed) == 1 and "HTTP 500" in postponed[0].payload["detail"]

    # the API comes back; once the wake-up time has passed the run simply carries on
    server.script = refund_script
    rewind(run.id)
    run = drive(run.id)

    assert run.status == Run.Status.SUCCEEDED, run.reason_detail
    assert len(refunds(sandbox)) == 1


@pytest.mark.django_db
@pytest.mark.usefixtures("llm_refund")
def test_a_cost_budget_counts_the_models_price(fake_llm, sandbox, system_actor):
    server = fake_llm()
    # 0.00045 for the first decision, 0.00115 for the second: over 0.001 after two
    run = run_create(
        agent_name="llm_refund", input=INPUT, actor=system_actor, max_cost=Decimal("0.001")
    )

    run = drive(run.id)

    assert run.status == Run.Status.NEEDS_ATTENTION
    assert run.reason_code == Run.Reason.BUDGET_EXHAUSTED
    assert "cost budget exhausted" in run.reason_detail
    assert run.cost_used == Decimal("0.001600")
    assert server.request_count == 2


@pytest.mark.django_db
@pytest.mark.usefixtures("llm_refund")
def test_a_request_the_api_rejects_fails_the_run_with_its_reason(fake_llm, sandbox, system_actor):
    server = fake_llm(lambda request, index: error(400, "context length exceeded"))
    run = run_create(agent_name="llm_refund", input=INPUT, actor=system_actor)

    run = drive(run.id)

    assert server.request_count == 1  # asking again would get the same answer
    assert run.status == Run.Status.FAILED
    assert run.reason_code == Run.Reason.AGENT_FAILED
    assert "context length exceeded" in run.reason_detail


@pytest.mark.django_db
@pytest.mark.usefixtures("llm_refund")
def test_unparseable_arguments_get_one_correction(fake_llm, sandbox, system_actor):
    def sloppy(request, index):
        if index == 0:
            reply = tool_call("lookup_order", {})
            reply.body["choices"][0]["message"]["tool_calls"][0]["function"]["arguments"] = "{oops"
            return reply
        return refund_script(request, index)

    server = fake_llm(sloppy)
    run = run_create(agent_name="llm_refund", input=INPUT, actor=system_actor)

    run = drive(run.id)

    assert run.status == Run.Status.SUCCEEDED
    correction = server.requests[1]["messages"][-1]
    assert correction["role"] == "tool" and "not valid JSON" in correction["content"]


@pytest.mark.django_db
@pytest.mark.usefixtures("llm_refund")
def test_a_call_to_a_tool_the_agent_may_not_use_is_refused_and_shown_to_the_model(
    fake_llm, sandbox, system_actor
):
    def wrong_tool(request, index):
        if index == 0:
            return tool_call("send_notification", {"to": "x@example.com"})
        if index == 1:
            return text("I may not send notifications.")
        raise AssertionError("asked too often")

    server = fake_llm(wrong_tool)
    run = run_create(agent_name="llm_refund", input=INPUT, actor=system_actor)

    run = drive(run.id)

    assert run.status == Run.Status.SUCCEEDED
    refused = json.loads(server.requests[1]["messages"][-2]["content"])
    assert refused["step_status"] == "failed"
    assert "may not use tool" in refused["error"]
    assert ToolCall.objects.filter(run=run).count() == 0  # nothing was dispatched


@pytest.mark.django_db
def test_long_histories_are_condensed_but_the_state_is_always_sent_whole(fake_llm):
    from runs.llm import CallRecord
    from runs.registry import StepView

    fake_llm(HISTORY_STEPS=3)
    agent = LLMRefundAgent()
    steps = tuple(
        StepView(
            seq=n,
            kind="tool_call",
            status="completed",
            input={"tool": "lookup_order", "arguments": {"order_id": f"ord_{n}"}},
            output={"n": n},
            error="",
        )
        for n in range(1, 9)
    )
    records = {
        n: CallRecord(status="succeeded", receipt_source="tool", attempts=1) for n in range(1, 9)
    }
    ctx = DecisionContext(run_id="r", goal="g", input={}, state={"big": "x" * 5000}, steps=steps)

    messages = agent.messages(ctx, records, history_steps=3)

    condensed = [m for m in messages if "condensed" in (m.get("content") or "")]
    assert len(condensed) == 1
    assert "step 1: lookup_order" in condensed[0]["content"]
    assert "step 5: lookup_order" in condensed[0]["content"]
    verbatim = [m["tool_call_id"] for m in messages if m["role"] == "tool"]
    assert verbatim == ["step_6", "step_7", "step_8"]
    assert "x" * 5000 in messages[-1]["content"]  # the authoritative state, whole


def test_a_registered_tool_becomes_a_function_schema():
    schema = tool_schema(registry.tool("refund_payment"))

    assert schema["function"]["name"] == "refund_payment"
    assert schema["function"]["parameters"] == registry.tool("refund_payment").schema
    assert "approval" in schema["function"]["description"]


@pytest.mark.django_db(transaction=True)
def test_the_model_is_never_called_inside_a_transaction(fake_llm):
    from runs.llm import ChatClient

    server = fake_llm()
    client = ChatClient(LLMConfig.from_settings())

    with pytest.raises(ModelCallInTransaction), transaction.atomic():
        client.complete({"model": "m", "messages": []})
    assert server.request_count == 0


@pytest.mark.django_db(transaction=True)
@pytest.mark.usefixtures("llm_refund")
def test_a_crash_right_after_the_decision_resumes_without_asking_the_model_again(
    fake_llm, sandbox, system_actor, monkeypatch
):
    """In-process: the worker 'dies' right after the commit of the second decision (the
    refund), before the refund is called; the next incarnation carries on from the record."""
    server = fake_llm()
    run = run_create(agent_name="llm_refund", input=INPUT, actor=system_actor)
    real_crash_point = faults.crash_point
    decided = []

    def crash_after_second_decision(boundary):
        if boundary == "decided":
            decided.append(1)
            if len(decided) == 2:
                raise WorkerKilled
        real_crash_point(boundary)

    monkeypatch.setattr(faults, "crash_point", crash_after_second_decision)
    with pytest.raises(WorkerKilled):
        drive(run.id, worker="doomed")
    assert server.request_count == 2
    assert refund_posts(sandbox) == []
    monkeypatch.setattr(faults, "crash_point", real_crash_point)
    Run.objects.filter(id=run.id).update(lease_expires_at=None)  # its holder is dead

    run = drive(run.id, worker="successor")
    if run.wake_at is not None:
        # the refund was in flight when it died: reconciliation found it absent and waits
        # until the original request could no longer land before sending it again
        rewind(run.id)
        run = drive(run.id, worker="successor")

    assert run.status == Run.Status.SUCCEEDED, run.reason_detail
    assert server.request_count == 3  # the third decision only: the refund was not re-asked
    assert len(refunds(sandbox)) == 1
    assert "run.claimed" in event_types(run.id)


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
@pytest.mark.usefixtures("roles")
def test_a_killed_worker_process_resumes_the_llm_run_without_asking_the_model_again(
    fake_llm, worker_procs, sandbox, system_actor
):
    """Real runworker processes: the demo registers its LLM agent because the model API is
    configured, the first worker SIGKILLs its process group right after the refund's
    decision commits, and a fresh worker finishes the run with one refund."""
    server = fake_llm()
    llm_env = {
        "AGENTOPS_LLM_BASE_URL": server.base_url,
        "AGENTOPS_LLM_API_KEY": "sk-test-key",
        "AGENTOPS_LLM_MODEL": "fake-model-2026",
    }
    registry.register_agent(LLMRefundAgent())  # here too, so run_create accepts it
    try:
        run = run_create(agent_name="llm_refund", input=INPUT, actor=system_actor)
    finally:
        registry.unregister_agent("llm_refund")

    crashing = worker_procs.start(
        "llm-crash", worker_env(sandbox, AGENTOPS_CRASH_AT="decided:2", **llm_env)
    )
    assert crashing.wait_exit(30) == -9, crashing.output()
    assert server.request_count == 2

    successor = worker_procs.start("llm-crash", worker_env(sandbox, **llm_env))
    wait_for(
        lambda: Run.objects.get(id=run.id).status == Run.Status.SUCCEEDED,
        30,
        what="the run to succeed",
    )
    successor.kill_group()

    assert server.request_count == 3
    assert len(refunds(sandbox)) == 1
    claims = events(run.id, "run.claimed")
    assert any(c.payload["recovered"] for c in claims)


@pytest.mark.django_db
@pytest.mark.usefixtures("llm_refund", "roles")
def test_the_model_can_ask_a_person_and_sees_the_answer(fake_llm, sandbox, system_actor, operator):
    from runs.actors import Actor
    from runs.models import Question
    from runs.waits import question_answer

    def ask_first(request, index):
        if index == 0:
            return tool_call(
                "ask_person", {"question": "Refund in full?", "choices": ["yes", "no"]}
            )
        answer = json.loads(request["messages"][-2]["content"])
        return fail_or_finish(answer)

    def fail_or_finish(answer):
        if answer["result"] == "no":
            return tool_call("fail_run", {"reason": "the operator said no"})
        return text("ok")

    server = fake_llm(ask_first)
    run = run_create(agent_name="llm_refund", input=INPUT, actor=system_actor)

    run = drive(run.id)
    assert run.status == Run.Status.WAITING_EVENT  # no worker is held while a person thinks
    question = Question.objects.get(run=run)
    assert (question.text, question.choices) == ("Refund in full?", ["yes", "no"])

    question_answer(question_id=question.id, answer="no", actor=Actor.for_user(operator, "web"))
    run = drive(run.id)

    assert server.request_count == 2
    assert run.status == Run.Status.FAILED
    assert run.reason_detail == "the operator said no"


# --- the model's answers on the record, replay, and the model policy ----------------------------


def _replay(run_id, *flags: str) -> tuple[int, str]:
    out = StringIO()
    try:
        call_command("replay", str(run_id), *flags, stdout=out)
        code = 0
    except SystemExit as exc:
        code = exc.code
    return code, out.getvalue()


def _replace_agent(agent: LLMAgent) -> None:
    """Deploy changed code under the registered name (the fixture unregisters it after)."""
    registry.unregister_agent(agent.name)
    registry.register_agent(agent)


@pytest.mark.django_db
@pytest.mark.usefixtures("llm_refund")
def test_each_decision_records_the_models_answer_with_sensitive_arguments_masked(
    fake_llm, sandbox, system_actor
):
    fake_llm()
    run = drive(run_create(agent_name="llm_refund", input=INPUT, actor=system_actor).id)

    answers = [e.payload["answers"] for e in events(run.id, "step.decided")]
    assert [len(a) for a in answers] == [1, 1, 1]
    lookup, refund, final = (a[0] for a in answers)
    assert lookup["tool_calls"][0]["function"]["name"] == "lookup_order"
    assert json.loads(lookup["tool_calls"][0]["function"]["arguments"]) == {"order_id": "ord_1002"}
    # refund_payment's customer_email is sensitive: the append-only record never holds it
    arguments = json.loads(refund["tool_calls"][0]["function"]["arguments"])
    assert arguments["customer_email"] == "***"
    assert arguments["amount_cents"] == 700
    assert "bob@example.com" not in json.dumps(refund)
    assert final["content"].startswith("Refunded 700 cents")
    # while the call itself was made with the real value
    refund_call = ToolCall.objects.get(run=run, tool_name="refund_payment")
    assert refund_call.arguments["customer_email"] == "bob@example.com"


@pytest.mark.django_db
@pytest.mark.usefixtures("llm_refund")
def test_a_corrected_decision_records_both_answers_and_replays_the_same(
    fake_llm, sandbox, system_actor
):
    def sloppy(request, index):
        if index == 0:
            reply = tool_call("lookup_order", {})
            reply.body["choices"][0]["message"]["tool_calls"][0]["function"]["arguments"] = "{oops"
            return reply
        return refund_script(request, index)

    server = fake_llm(sloppy)
    run = drive(run_create(agent_name="llm_refund", input=INPUT, actor=system_actor).id)
    first = events(run.id, "step.decided")[0].payload["answers"]
    assert [a["tool_calls"][0]["function"]["arguments"] for a in first][0] == "{oops"
    asked = server.request_count

    code, output = _replay(run.id)

    assert (code, server.request_count) == (0, asked), output
    assert "step 1: same: call lookup_order" in output


@pytest.mark.django_db
@pytest.mark.usefixtures("llm_refund")
def test_replay_reuses_the_recorded_answers_and_asks_the_model_nothing(
    fake_llm, sandbox, system_actor
):
    server = fake_llm()
    run = drive(run_create(agent_name="llm_refund", input=INPUT, actor=system_actor).id)
    asked, recorded = server.request_count, event_types(run.id)
    posts = len(refund_posts(sandbox))

    code, output = _replay(run.id)

    assert code == 0, output
    assert "reusing the recorded model answers" in output
    assert "step 1: same: call lookup_order" in output
    assert "step 2: same: call refund_payment" in output
    assert "step 3: same: finish" in output
    assert output.strip().endswith("identical")
    assert server.request_count == asked  # not one request
    assert len(refund_posts(sandbox)) == posts  # no tool ran
    assert event_types(run.id) == recorded  # nothing written


class _ShortChangingRefund(LLMRefundAgent):
    """Changed code: maps the model's refund call to 100 cents less (a bug replay catches)."""

    def _action(self, message):
        action, problem = super()._action(message)
        if isinstance(action, CallTool) and action.tool == "refund_payment":
            arguments = {**action.arguments, "amount_cents": action.arguments["amount_cents"] - 100}
            action = CallTool(action.tool, arguments)
        return action, problem


class _RenamedTool(LLMRefundAgent):
    """Changed code: lookup_order was renamed, so the model's recorded call is no tool of it."""

    tools = ("refund_payment",)

    def _action(self, message):
        action, problem = super()._action(message)
        if isinstance(action, CallTool) and action.tool == "lookup_order":
            return None, "lookup_order is gone"
        return action, problem


@pytest.mark.django_db
@pytest.mark.usefixtures("llm_refund")
def test_replay_of_recorded_answers_reports_a_changed_mapping(fake_llm, sandbox, system_actor):
    server = fake_llm()
    run = drive(run_create(agent_name="llm_refund", input=INPUT, actor=system_actor).id)
    asked = server.request_count
    _replace_agent(_ShortChangingRefund())

    code, output = _replay(run.id)

    assert code == 3, output
    assert "step 1: same: call lookup_order" in output
    assert "step 2: DIVERGED: would call refund_payment with amount_cents 600 instead of 700" in (
        output
    )
    assert "step 3: same: finish" in output
    assert "bob@example.com" not in output
    assert server.request_count == asked


@pytest.mark.django_db
@pytest.mark.usefixtures("llm_refund")
def test_replay_of_recorded_answers_reports_a_step_todays_code_would_not_accept(
    fake_llm, sandbox, system_actor
):
    server = fake_llm()
    run = drive(run_create(agent_name="llm_refund", input=INPUT, actor=system_actor).id)
    asked = server.request_count
    _replace_agent(_RenamedTool())

    code, output = _replay(run.id)

    # today's code would have asked the model to correct itself: an answer never recorded
    assert code == 3, output
    assert "step 1: NOT CHECKED: no recorded answer" in output
    assert "step 2: same: call refund_payment" in output
    assert server.request_count == asked


@pytest.mark.django_db
@pytest.mark.usefixtures("llm_refund")
def test_steps_recorded_without_answers_are_reported_not_checked(
    fake_llm, sandbox, system_actor, monkeypatch
):
    server = fake_llm()
    ask = LLMAgent.ask

    def without_answers(self, *args, **kwargs):  # as recorded before answers were kept
        decision = ask(self, *args, **kwargs)
        return Decision(decision.action, dataclasses.replace(decision.usage, answers=()))

    monkeypatch.setattr(LLMAgent, "ask", without_answers)
    run = drive(run_create(agent_name="llm_refund", input=INPUT, actor=system_actor).id)
    assert run.status == Run.Status.SUCCEEDED
    assert all("answers" not in e.payload for e in events(run.id, "step.decided"))
    asked = server.request_count

    code, output = _replay(run.id)

    assert code == 3, output
    assert output.count("NOT CHECKED: no recorded answer") == 3
    assert "3 of 3 steps not checked" in output
    assert server.request_count == asked


@pytest.mark.django_db
@pytest.mark.usefixtures("llm_refund")
def test_live_model_replay_asks_again_writes_nothing_and_reports_a_new_answer(
    fake_llm, sandbox, system_actor
):
    server = fake_llm()
    run = drive(run_create(agent_name="llm_refund", input=INPUT, actor=system_actor).id)
    Run.objects.filter(id=run.id).update(model_id="")  # even unpinned: replay pins nothing
    recorded, posts = event_types(run.id), len(refund_posts(sandbox))

    code, output = _replay(run.id, "--live-model")

    assert code == 0, output
    assert "asking fake-model-2026 again" in output
    assert server.request_count == 6  # three decisions, asked again
    assert {r["model"] for r in server.requests[3:]} == {"fake-model-2026"}
    # the conversation is rebuilt from the record, as decide builds it
    assert server.requests[4]["messages"] == server.requests[1]["messages"]
    assert event_types(run.id) == recorded
    assert Run.objects.get(id=run.id).model_id == ""
    assert len(refund_posts(sandbox)) == posts

    def half_refund(request, index):  # the model now answers differently
        reply = refund_script(request, index)
        message = reply.body["choices"][0]["message"]
        for call in message.get("tool_calls") or []:
            if call["function"]["name"] == "refund_payment":
                arguments = json.loads(call["function"]["arguments"])
                call["function"]["arguments"] = json.dumps({**arguments, "amount_cents": 350})
        return reply

    server.script = half_refund
    code, output = _replay(run.id, "--live-model")

    assert code == 3, output
    assert "step 2: DIVERGED: would call refund_payment with amount_cents 350 instead of 700" in (
        output
    )
    assert server.request_count == 9
    assert event_types(run.id) == recorded


@pytest.mark.django_db
@pytest.mark.usefixtures("llm_refund")
def test_live_model_replay_without_a_model_is_a_one_line_error(fake_llm, sandbox, system_actor):
    fake_llm()
    run = drive(run_create(agent_name="llm_refund", input=INPUT, actor=system_actor).id)
    settings.AGENTOPS_LLM["BASE_URL"] = ""

    with pytest.raises(CommandError, match="--live-model needs a model to ask"):
        call_command("replay", str(run.id), "--live-model", stdout=StringIO())


@pytest.mark.django_db
def test_live_model_replay_of_an_agent_without_a_model_is_refused(sandbox, system_actor):
    run = drive(
        run_create(
            agent_name="refund",
            input={"order_id": "ord_1001", "amount_cents": 500},
            actor=system_actor,
        ).id
    )
    with pytest.raises(CommandError, match="not model-backed"):
        call_command("replay", str(run.id), "--live-model", stdout=StringIO())


class _FollowingRefund(LLMRefundAgent):
    name = "llm_refund_follow"
    model_policy = "follow"


def _ask_then_finish(request, index):
    if index == 0:
        return tool_call("ask_person", {"question": "Refund in full?", "choices": ["yes", "no"]})
    return text("ok")


def _answer_and_drive(run_id, operator):
    from runs.actors import Actor
    from runs.models import Question
    from runs.waits import question_answer

    question = Question.objects.get(run_id=run_id)
    question_answer(question_id=question.id, answer="yes", actor=Actor.for_user(operator, "web"))
    return drive(run_id)


@pytest.mark.django_db
def test_a_following_agent_moves_its_run_to_the_new_model_recorded(
    fake_llm, sandbox, system_actor, operator, register
):
    register(_FollowingRefund())
    server = fake_llm(_ask_then_finish)
    run = drive(run_create(agent_name="llm_refund_follow", input=INPUT, actor=system_actor).id)
    assert run.status == Run.Status.WAITING_EVENT
    assert events(run.id, "run.model_changed") == []  # nothing changed yet
    settings.AGENTOPS_LLM["MODEL"] = "a-newer-model"  # deployed while the run waits

    run = _answer_and_drive(run.id, operator)

    assert run.status == Run.Status.SUCCEEDED
    assert [r["model"] for r in server.requests] == ["fake-model-2026", "a-newer-model"]
    assert run.model_id == "a-newer-model"
    changed = events(run.id, "run.model_changed")
    assert [(e.payload["from"], e.payload["to"]) for e in changed] == [
        ("fake-model-2026", "a-newer-model")
    ]
    assert changed[0].actor.startswith("worker:")
    assert describe("run.model_changed", changed[0].payload).startswith(
        "model changed from fake-model-2026 to a-newer-model"
    )
    # recorded before the decision that used it
    decided = events(run.id, "step.decided")[-1]
    assert changed[0].seq < decided.seq
    assert decided.payload["usage"]["model"] == "a-newer-model"


@pytest.mark.django_db
@pytest.mark.usefixtures("llm_refund")
def test_a_pinning_agent_keeps_its_run_on_the_model_it_started_with(
    fake_llm, sandbox, system_actor, operator
):
    assert LLMRefundAgent.model_policy == "pin"
    server = fake_llm(_ask_then_finish)
    run = drive(run_create(agent_name="llm_refund", input=INPUT, actor=system_actor).id)
    settings.AGENTOPS_LLM["MODEL"] = "a-newer-model"

    run = _answer_and_drive(run.id, operator)

    assert run.status == Run.Status.SUCCEEDED
    assert [r["model"] for r in server.requests] == ["fake-model-2026", "fake-model-2026"]
    assert run.model_id == "fake-model-2026"
    assert events(run.id, "run.model_changed") == []
    # a question the model asked replays too, from its recorded answer
    code, output = _replay(run.id)
    assert code == 0, output
    assert "step 1: same: ask 'Refund in full?'" in output
    assert server.request_count == 2


def test_an_unknown_model_policy_is_refused_when_the_agent_is_defined():
    with pytest.raises(TypeError, match="model_policy"):

        class _Typo(LLMAgent):  # noqa: F841 (defining it is the test)
            name = "typo"
            model_policy = "folow"


@pytest.mark.django_db
@pytest.mark.usefixtures("llm_refund")
def test_a_withdrawn_model_parks_the_run_and_retry_follows_the_configured_model(
    fake_llm, sandbox, system_actor, operator
):
    from runs.actors import Actor
    from runs.services import InvalidState, run_retry_recovery

    def script(request, index):
        if request["model"] == "fake-model-2026":
            return Reply(
                status=404,
                body={
                    "error": {
                        "message": "The model `fake-model-2026` does not exist",
                        "code": "model_not_found",
                    }
                },
            )
        return refund_script(request, index - 1)

    server = fake_llm(script)
    run = run_create(agent_name="llm_refund", input=INPUT, actor=system_actor, max_tokens=10_000)

    run = drive(run.id)

    assert server.request_count == 1  # not retried: the model will not come back by itself
    assert (run.status, run.reason_code) == (Run.Status.NEEDS_ATTENTION, "model_unavailable")
    assert "'fake-model-2026' is not available" in run.reason_detail
    olivia = Actor.for_user(operator, "web")
    with (
        pytest.raises(InvalidState, match="the configured model is still fake-model-2026"),
        transaction.atomic(),
    ):
        run_retry_recovery(run_id=run.id, actor=olivia)

    settings.AGENTOPS_LLM["MODEL"] = "fake-model-2027"  # the deploy that configures a new one
    run_retry_recovery(run_id=run.id, actor=olivia)
    run = drive(run.id)

    assert run.status == Run.Status.SUCCEEDED, run.reason_detail
    assert run.model_id == "fake-model-2027"
    [changed] = events(run.id, "run.model_changed")
    assert changed.payload == {
        "from": "fake-model-2026",
        "to": "fake-model-2027",
        "by": f"user:{operator.get_username()}",
    }
    assert len(refunds(sandbox)) == 1


@pytest.mark.django_db
@pytest.mark.usefixtures("llm_refund")
def test_a_fork_of_a_run_whose_model_is_gone_takes_the_configured_model(
    fake_llm, sandbox, system_actor, operator
):
    from runs.actors import Actor
    from runs.services import run_fork

    def script(request, index):
        # the pinned model answers the first decision, then is withdrawn
        if request["model"] == "fake-model-2026" and tool_results(request):
            return error(404, "no such model")
        return refund_script(request, index)

    fake_llm(script)
    run = drive(
        run_create(agent_name="llm_refund", input=INPUT, actor=system_actor, max_tokens=10_000).id
    )
    assert run.reason_code == "model_unavailable"
    settings.AGENTOPS_LLM["MODEL"] = "fake-model-2027"

    fork = run_fork(run_id=run.id, actor=Actor.for_user(operator, "web"), from_step=1)

    assert fork.model_id == "fake-model-2027"
    forked = events(fork.id, "run.forked")[0].payload
    assert forked["model"] == {"from": "fake-model-2026", "to": "fake-model-2027"}
    fork = drive(fork.id)
    assert fork.status == Run.Status.SUCCEEDED, fork.reason_detail
    assert len(refunds(sandbox)) == 1

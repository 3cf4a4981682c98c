"""``manage.py replay``: today's code against the record, with no tool executed."""

from __future__ import annotations

import uuid
from io import StringIO

import pytest
from django.core.management import CommandError, call_command

from runs.models import Run
from runs.registry import CallTool, Finish, Sleep, WaitForSignal, registry, tool_fingerprint
from runs.services import run_create
from tests.conftest import drive
from tests.runs.wait_support import fall_due, waits_then_finishes
from tests.support import CountingTool, ScriptedAgent, make_tool, refund_posts

pytestmark = pytest.mark.django_db


def _replay(run_id) -> tuple[int, str]:
    out = StringIO()
    try:
        call_command("replay", str(run_id), stdout=out)
        code = 0
    except SystemExit as exc:
        code = exc.code
    return code, out.getvalue()


def test_replay_of_an_unchanged_agent_is_identical_and_calls_nothing(sandbox, system_actor):
    run = drive(
        run_create(
            agent_name="refund",
            input={"order_id": "ord_1001", "amount_cents": 500},
            actor=system_actor,
        ).id
    )
    posts = len(refund_posts(sandbox))

    code, output = _replay(run.id)

    assert code == 0
    assert "step 1: same: call lookup_order" in output
    assert "step 2: same: call refund_payment" in output
    assert "step 3: same: finish" in output
    assert output.strip().endswith("identical")
    assert len(refund_posts(sandbox)) == posts  # nothing was sent


@pytest.fixture
def refunder(register):
    body = CountingTool()
    plan = {"amount": 50}

    def decide(ctx):
        if not ctx.steps:
            return CallTool("replay_refund", {"amount": plan["amount"], "card": "4242-4242-SECRET"})
        return Finish({"refunded": ctx.state.get("refunded")})

    agent = ScriptedAgent("replayed", decide, tools=("replay_refund",))
    agent.apply = lambda state, step: {**state, "refunded": step.status == "completed"}
    tool = make_tool("replay_refund", body)
    tool.sensitive_fields = ("card",)
    register(tool, agent)
    return body, plan


def test_replay_after_an_agent_change_reports_the_divergence(refunder, system_actor):
    body, plan = refunder
    run = drive(run_create(agent_name="replayed", actor=system_actor).id)
    assert run.result == {"refunded": True}
    plan["amount"] = 40

    code, output = _replay(run.id)

    assert code == 3
    assert "step 1: DIVERGED: would call replay_refund with amount 40 instead of 50" in output
    assert "4242-4242-SECRET" not in output  # sensitive arguments stay masked
    assert "step 2: same: finish" in output  # state folded from the recorded outcome
    assert len(body.calls) == 1


def test_replay_of_an_unknown_run_is_a_one_line_error():
    with pytest.raises(CommandError, match="no run"):
        call_command("replay", str(uuid.uuid4()))
    with pytest.raises(CommandError, match="no run"):
        call_command("replay", "not-a-uuid")


def test_replay_of_signal_and_timer_waits_with_unchanged_code_is_identical(register, system_actor):
    agent = register(
        waits_then_finishes(
            "replay_waiter",
            WaitForSignal("go", timeout_seconds=60, default={"go": False}),
            Sleep(seconds=30),
        )
    )
    run = drive(run_create(agent_name=agent.name, actor=system_actor).id)
    fall_due(run.id)
    run = drive(run.id)
    fall_due(run.id)
    run = drive(run.id)
    assert run.status == Run.Status.SUCCEEDED

    code, output = _replay(run.id)

    assert code == 0, output
    assert "step 1: same: wait for signal 'go'" in output
    assert "step 2: same: sleep until" in output
    assert output.strip().endswith("identical")


def test_replay_reports_a_signal_wait_for_another_name_as_diverged(register, system_actor):
    waits = [WaitForSignal("go", timeout_seconds=60)]
    agent = register(
        ScriptedAgent("replay_renamed", lambda ctx: waits[0] if not ctx.steps else Finish())
    )
    run = drive(run_create(agent_name=agent.name, actor=system_actor).id)
    fall_due(run.id)
    assert drive(run.id).status == Run.Status.SUCCEEDED
    waits[0] = WaitForSignal("start", timeout_seconds=60)

    code, output = _replay(run.id)

    assert code == 3
    assert "step 1: DIVERGED: would wait for signal 'start' instead of 'go'" in output


def test_replay_reports_a_changed_tool_as_diverged(refunder, system_actor):
    run = drive(run_create(agent_name="replayed", actor=system_actor).id)
    tool = registry.tool("replay_refund")
    recorded = tool.version
    tool.schema = {"type": "object", "properties": {"amount": {"type": "integer"}}}
    tool.version = tool_fingerprint(tool)
    assert tool.version != recorded

    code, output = _replay(run.id)

    assert code == 3
    assert (
        f"step 1: DIVERGED: tool replay_refund changed: called on version {recorded}, "
        f"today's is {tool.version}"
    ) in output

    tool.compatible_with = (recorded,)  # declared compatible on purpose: not a divergence
    code, output = _replay(run.id)
    assert code == 0, output


def test_replay_reports_a_retired_tool_as_diverged(refunder, system_actor):
    run = drive(run_create(agent_name="replayed", actor=system_actor).id)
    recorded = registry.tool("replay_refund").version
    registry.unregister_tool("replay_refund")
    try:
        code, output = _replay(run.id)
    finally:
        registry.register_tool(make_tool("replay_refund", CountingTool()))

    assert code == 3
    assert (
        f"step 1: DIVERGED: tool replay_refund is retired (called on version {recorded})" in output
    )

"""A tool's or a lookup's answer records a real effect: a value that cannot be stored as it
is (a NUL character, a string too long, nesting too deep) is replaced, the receipt is
written and the run goes on — never a receipt that fails after the effect (issue 18)."""

from __future__ import annotations

import pytest

from runs.models import Run, ToolCall
from runs.registry import CallTool, Effect, Finish, ToolResult
from runs.services import run_create
from tests.conftest import drive
from tests.support import CountingTool, ScriptedAgent, events, make_tool

pytestmark = pytest.mark.django_db


def _deep(levels: int):
    value: object = 1
    for _ in range(levels):
        value = {"a": value}
    return value


@pytest.mark.parametrize("effect", [Effect.READ, Effect.IDEMPOTENT])
def test_an_answer_that_cannot_be_stored_as_it_is_is_kept_with_the_bad_parts_replaced(
    register, system_actor, effect
):
    body = CountingTool(
        lambda arguments, ctx: ToolResult(
            result={"note": "paid\u0000", "deep": _deep(200)}, external_ref="ref\u0000" + "x" * 300
        )
    )
    register(
        make_tool("storable_tool", body, effect=effect),
        ScriptedAgent(
            "storable",
            lambda ctx: (
                CallTool("storable_tool", {})
                if not ctx.steps
                else Finish({"status": ctx.last_step.status})
            ),
            tools=("storable_tool",),
        ),
    )

    run = drive(run_create(agent_name="storable", actor=system_actor).id)

    assert run.status == Run.Status.SUCCEEDED
    assert len(body.calls) == 1  # the effect happened once, and is recorded
    receipt = ToolCall.objects.get(run=run).receipt
    assert receipt.result["note"] == "paid\ufffd"
    assert "removed: nested deeper" in str(receipt.result["deep"])
    assert len(receipt.external_ref) == 200 and "\x00" not in receipt.external_ref
    (succeeded,) = events(run.id, "tool.succeeded")
    assert any("NUL" in note for note in succeeded.payload["stored_with_changes"])

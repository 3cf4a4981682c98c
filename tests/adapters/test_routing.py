"""CallRouter's matching, without a server: a framework re-issues its tool calls when it
resumes, and each must meet the call the run recorded for it — never a second proposal, and
never a call an earlier model response made."""

from __future__ import annotations

from typing import Any

from agentops.client import Executed, Proposal, Resume
from agentops.client.routing import CallRouter

REFUND = {"order_id": "ord_1", "amount_cents": 500}


def _step(seq: int, kind: str = "tool_call", status: str = "completed", **data: Any) -> dict:
    return {"seq": seq, "kind": kind, "status": status, "input": {}, "output": None, **data}


def _call(seq: int, status: str) -> dict:
    return {
        "id": 100 + seq,
        "step_seq": seq,
        "tool": "refund",
        "status": status,
        "idempotency_key": f"r:{seq}",
        "arguments": REFUND,
    }


class FakeRun:
    """What the router uses of a RemoteRun; records what it was asked."""

    def __init__(self, steps: list[dict] = (), calls: list[dict] = ()) -> None:
        self.resume = Resume.from_json(
            {
                "run": "r",
                "agent_version": "1",
                "steps": list(steps),
                "open_tool_calls": list(calls),
                "unknown_outcomes": [c for c in calls if c["status"] == "unknown"],
            }
        )
        self.asked: list[tuple[str, Any]] = []
        self.call_ids: list[str | None] = []
        self.decision = "approved"

    def propose(self, tool: str, arguments: dict, *, call_id: str | None = None) -> Proposal:
        self.asked.append(("propose", tool))
        self.call_ids.append(call_id)
        seq = self.resume.next_seq + len([a for a in self.asked if a[0] == "propose"]) - 1
        return Proposal(self.decision, seq, 100 + seq, None, "")

    def execute(self, tool_call_id: int, tool, lookup=None) -> Executed:
        self.asked.append(("execute", tool_call_id))
        return Executed("succeeded", {"sent": tool_call_id})

    def reconcile(self, tool_call_id: int, tool, lookup=None) -> Executed:
        self.asked.append(("reconcile", tool_call_id))
        return Executed("succeeded", {"found": tool_call_id}, "reconciliation")

    def stop_heartbeat(self) -> None:
        self.asked.append(("stop_heartbeat", None))


def body(arguments, ctx) -> None:
    raise AssertionError("the fake run never calls the tool")


def _recorded(seq: int, result: Any) -> dict:
    return _step(seq, input={"tool": "agent/refund", "arguments": REFUND}, output=result)


def test_a_call_recorded_after_the_checkpoint_answers_with_its_result():
    run = FakeRun(steps=[_step(1, "decision"), _recorded(2, {"refund_id": "rf_1"})])
    router = CallRouter(run)
    router.resume_from(1)
    routed = router.route("refund", REFUND, body)
    assert (routed.status, routed.result) == ("succeeded", {"refund_id": "rf_1"})
    assert run.asked == []  # nothing proposed, dispatched or looked up


def test_a_call_an_earlier_response_made_is_not_taken_for_this_one():
    # the model refunds the same amount again in a later response: a new call
    run = FakeRun(
        steps=[_step(1, "decision"), _recorded(2, {"refund_id": "rf_1"}), _step(3, "decision")]
    )
    router = CallRouter(run)
    router.resume_from(3)
    routed = router.route("refund", REFUND, body)
    assert routed.status == "succeeded"
    assert run.asked == [("propose", "refund"), ("execute", 104)]


def test_each_recorded_call_is_adopted_once():
    run = FakeRun(steps=[_step(1, "decision"), _recorded(2, {"refund_id": "rf_1"})])
    router = CallRouter(run)
    router.resume_from(1)
    assert router.route("refund", REFUND, body).result == {"refund_id": "rf_1"}
    assert router.route("refund", REFUND, body).result == {"sent": 103}
    assert run.asked == [("propose", "refund"), ("execute", 103)]


def test_an_unknown_call_is_looked_up_and_an_approved_one_dispatched():
    unknown = CallRouter(FakeRun(steps=[_step(1, "decision")], calls=[_call(2, "unknown")]))
    unknown.resume_from(1)
    assert unknown.route("refund", REFUND, body).result == {"found": 102}
    assert unknown.run.asked == [("reconcile", 102)]

    approved = CallRouter(FakeRun(steps=[_step(1, "decision")], calls=[_call(2, "approved")]))
    approved.resume_from(1)
    assert approved.route("refund", REFUND, body).result == {"sent": 102}
    assert approved.run.asked == [("execute", 102)]


def test_once_parked_the_router_asks_the_server_nothing_more():
    run = FakeRun()
    run.decision = "awaiting_approval"
    router = CallRouter(run)
    first = router.route("refund", REFUND, body)
    second = router.route("refund", {"order_id": "ord_2", "amount_cents": 1}, body)
    assert first.status == second.status == "parked"
    assert run.asked == [("propose", "refund"), ("stop_heartbeat", None)]

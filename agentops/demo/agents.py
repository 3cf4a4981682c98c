"""Demo agents: a refund agent and a customer follow-up agent.

They decide deterministically from the authoritative state and step history, so a resumed
run makes the same decisions an uninterrupted one would have made.
"""

from __future__ import annotations

from typing import Any

from agentops.demo.tools import ALL_TOOLS
from runs.registry import Agent, CallTool, DecisionContext, Fail, Finish, StepView, registry


class RefundAgent(Agent):
    name = "refund"
    version = "1"
    description = "Looks up an order and refunds it; refunds above 100.00 need an approver."
    tools = ("lookup_order", "refund_payment")
    input_schema = {
        "type": "object",
        "properties": {
            "order_id": {"type": "string", "pattern": "^ord_[0-9]+$"},
            "amount_cents": {"type": "integer", "minimum": 1},
            "reason": {"type": "string", "maxLength": 500},
        },
        "required": ["order_id", "amount_cents"],
        "additionalProperties": False,
    }

    def initial_state(self, input: Any) -> dict[str, Any]:
        return {"order": None, "refund": None}

    def decide(self, ctx: DecisionContext) -> Any:
        last = ctx.last_step
        order_id = ctx.input["order_id"]
        amount = ctx.input["amount_cents"]
        if last is None:
            return CallTool("lookup_order", {"order_id": order_id})
        tool = last.input.get("tool")
        if tool == "lookup_order":
            if last.status != "completed":
                return Fail(f"could not look up order {order_id}: {last.error}")
            order = last.output
            refundable = order["amount_cents"] - order.get("refunded_cents", 0)
            if amount > refundable:
                return Fail(f"cannot refund {amount}: only {refundable} is refundable")
            return CallTool(
                "refund_payment",
                {
                    "order_id": order_id,
                    "amount_cents": amount,
                    "reason": ctx.input.get("reason", ""),
                    "customer_email": order["customer"],
                },
            )
        if tool == "refund_payment":
            if last.status == "completed":
                return Finish({"refunded": True, "refund_id": last.output.get("refund_id")})
            return Finish({"refunded": False, "why": last.error})
        return Fail(f"unexpected step {last.seq} ({tool})")

    def apply(self, state: dict[str, Any], step: StepView) -> dict[str, Any]:
        if step.status == "completed" and step.input.get("tool") == "lookup_order":
            state["order"] = step.output
        if step.status == "completed" and step.input.get("tool") == "refund_payment":
            state["refund"] = step.output
        return state


class FollowUpAgent(Agent):
    name = "followup"
    version = "1"
    description = "Looks up an order and sends the customer a message (an unsafe tool)."
    tools = ("lookup_order", "send_notification")
    input_schema = {
        "type": "object",
        "properties": {
            "order_id": {"type": "string", "pattern": "^ord_[0-9]+$"},
            "message": {"type": "string", "minLength": 1},
        },
        "required": ["order_id", "message"],
        "additionalProperties": False,
    }

    def decide(self, ctx: DecisionContext) -> Any:
        last = ctx.last_step
        if last is None:
            return CallTool("lookup_order", {"order_id": ctx.input["order_id"]})
        tool = last.input.get("tool")
        if tool == "lookup_order":
            if last.status != "completed":
                return Fail(f"could not look up the order: {last.error}")
            customer = last.output["customer"]
            return CallTool(
                "send_notification",
                {
                    "to": customer,
                    "subject": f"About your order {ctx.input['order_id']}",
                    "body": ctx.input["message"],
                },
            )
        if tool == "send_notification":
            if last.status == "completed":
                return Finish(
                    {"notified": True, "notification_id": last.output.get("notification_id")}
                )
            return Fail(f"could not notify the customer: {last.error}")
        return Fail(f"unexpected step {last.seq}")


def register() -> None:
    for tool in ALL_TOOLS:
        registry.register_tool(tool)
    registry.register_agent(RefundAgent())
    registry.register_agent(FollowUpAgent())

"""Demo agents: a refund agent, a customer follow-up agent, and an onboarding agent that
waits for a person's answer and for an external signal (docs/waits.md).

They decide deterministically from the authoritative state and step history, so a resumed
run makes the same decisions an uninterrupted one would have made.
"""

from __future__ import annotations

from typing import Any

from agentops.demo.tools import ALL_TOOLS
from runs.registry import (
    Agent,
    AskQuestion,
    CallTool,
    DecisionContext,
    Fail,
    Finish,
    StepView,
    WaitForSignal,
    approval_refusal,
    registry,
)


class RefundAgent(Agent):
    name = "refund"
    version = "1"
    description = "Looks up an order and refunds it; refunds above 100.00 need an approver."
    tools = ("lookup_order", "refund_payment")
    searchable_input = ("order_id",)
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
            if (
                last.status == "completed"
                and isinstance(last.output, dict)
                and last.output.get("dry_run")
            ):
                # a dry run (docs/agents.md): the tool said what it would have done
                return Finish({"refunded": False, "dry_run": True, "would": last.output["would"]})
            if last.status == "completed":
                return Finish({"refunded": True, "refund_id": last.output.get("refund_id")})
            refused = approval_refusal(last)
            if refused:
                # the approver said no, or nobody decided in time: the run says so
                return Fail(f"refund of {amount} not approved: {last.error}", code=refused)
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
    searchable_input = ("order_id",)
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
                # an operator who resolved a lost outcome as "it happened" may give no result
                output = last.output if isinstance(last.output, dict) else {}
                if output.get("dry_run"):
                    return Finish({"notified": False, "dry_run": True, "would": output["would"]})
                return Finish({"notified": True, "notification_id": output.get("notification_id")})
            return Fail(f"could not notify the customer: {last.error}")
        return Fail(f"unexpected step {last.seq}")


class OnboardingAgent(Agent):
    """Asks an operator which plan a new customer gets, then waits for the payment system's
    ``payment_confirmed`` signal (``POST /api/v1/runs/{id}/signals/``). Neither wait holds a
    worker. Unanswered, the plan defaults to ``starter``; with no payment signal in time the
    customer is onboarded unpaid, for a person to follow up."""

    name = "onboarding"
    version = "1"
    description = "Asks an operator to choose a plan, then waits for payment_confirmed."
    tools = ()
    searchable_input = ("customer",)
    PLANS = ("starter", "pro", "enterprise")
    input_schema = {
        "type": "object",
        "properties": {
            "customer": {"type": "string", "minLength": 1, "maxLength": 200},
            "question_ttl_seconds": {"type": "number", "exclusiveMinimum": 0},
            "payment_timeout_seconds": {"type": "number", "minimum": 0},
        },
        "required": ["customer"],
        "additionalProperties": False,
    }

    def initial_state(self, input: Any) -> dict[str, Any]:
        return {"plan": None, "payment": None}

    def decide(self, ctx: DecisionContext) -> Any:
        last = ctx.last_step
        if last is None:
            return AskQuestion(
                text=f"Which plan should {ctx.input['customer']} start on?",
                choices=list(self.PLANS),
                group="operator",
                ttl_seconds=ctx.input.get("question_ttl_seconds", 24 * 3600),
                default="starter",
            )
        if last.kind != "wait" or last.status != "completed":
            return Fail(f"unexpected step {last.seq}: {last.kind} {last.status} {last.error}")
        if last.input.get("wait") == "question":
            return WaitForSignal(
                "payment_confirmed",
                timeout_seconds=ctx.input.get("payment_timeout_seconds", 3 * 24 * 3600),
                default={"confirmed": False},
            )
        payment = last.output if isinstance(last.output, dict) else {"confirmed": bool(last.output)}
        return Finish(
            {
                "customer": ctx.input["customer"],
                "plan": ctx.state.get("plan"),
                "paid": payment.get("confirmed", True),
                "payment": payment,
            }
        )

    def apply(self, state: dict[str, Any], step: StepView) -> dict[str, Any]:
        if step.kind == "wait" and step.status == "completed":
            if step.input.get("wait") == "question":
                state["plan"] = step.output
            elif step.input.get("wait") == "signal":
                state["payment"] = step.output
        return state


def register() -> None:
    for tool in ALL_TOOLS:
        registry.register_tool(tool)
    registry.register_agent(RefundAgent())
    registry.register_agent(FollowUpAgent())
    registry.register_agent(OnboardingAgent())
    from django.conf import settings

    if settings.AGENTOPS_LLM["BASE_URL"]:
        # only with a model API configured: without one its runs could never decide
        from agentops.demo.llm_agents import LLMRefundAgent

        registry.register_agent(LLMRefundAgent())

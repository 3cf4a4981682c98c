"""The demo's LLM-backed agent (runs/llm.py): the refund job, decided by a language model
through an OpenAI-compatible API. Registered only when ``AGENTOPS_LLM_BASE_URL`` is set
(docs/operations.md, "LLM agents"); its tools, approvals and recovery are the same as the
deterministic ``refund`` agent's."""

from __future__ import annotations

from agentops.demo.agents import RefundAgent
from runs.llm import LLMAgent


class LLMRefundAgent(LLMAgent):
    name = "llm_refund"
    version = "1"
    description = (
        "A language model handles a refund request: looks the order up, refunds what is "
        "refundable (above 100.00 an approver decides), and reports back."
    )
    tools = ("lookup_order", "refund_payment")
    input_schema = RefundAgent.input_schema
    searchable_input = RefundAgent.searchable_input
    instructions = (
        "You handle refund requests for a payments team. Look the order up first. Refund "
        "only an amount that is still refundable (the order's amount minus what was already "
        "refunded), to the order's customer, with the reason you were given. Never refund "
        "an order twice: if the history shows a refund succeeded, finish. When done, answer "
        "with one sentence saying what happened and the refund id."
    )

"""A remote agent's manifest for the API tests, and helpers to drive its runs over the API."""

from __future__ import annotations

from typing import Any

from rest_framework.test import APIClient

from runs.actors import Actor
from runs.models import Run
from runs.remote import agent_manifest_put
from runs.services import run_create

REFUND_SCHEMA = {
    "type": "object",
    "properties": {
        "order_id": {"type": "string"},
        "amount_cents": {"type": "integer", "minimum": 1},
        "card": {"type": "string"},
    },
    "required": ["order_id", "amount_cents"],
    "additionalProperties": False,
}

MANIFEST: dict[str, Any] = {
    "version": "1",
    "input_schema": {
        "type": "object",
        "properties": {"order_id": {"type": "string"}},
        "required": ["order_id"],
    },
    "tools": [
        {
            "name": "refund",
            "effect": "reconcilable",
            "argument_schema": REFUND_SCHEMA,
            "sensitive_fields": ["card"],
            "timeout": 5,
            "approval": {
                "when": {"argument": "amount_cents", "op": "gt", "value": 10000},
                "group": "approver",
            },
        },
        {"name": "notify", "effect": "unsafe"},
        {"name": "lookup", "effect": "read"},
        {"name": "charge", "effect": "idempotent", "precondition": True},
    ],
    "question_groups": ["operator"],
}


def register_remote(
    admin, name: str = "pay_bot", manifest: dict | None = None, *, owner=None
) -> None:
    """Register the manifest; ``owner`` (a user in the agent role) may drive its runs."""
    manifest = {**(manifest or MANIFEST)}
    if owner is not None:
        manifest["owner"] = owner.get_username()
    agent_manifest_put(name=name, manifest=manifest, actor=Actor.for_user(admin, "cli"))


def remote_run(principal, agent: str = "pay_bot", **input) -> Run:
    return run_create(
        agent_name=agent,
        input=input or {"order_id": "ord_1001"},
        actor=Actor.for_user(principal, "api"),
    )


class Agent:
    """One agent process's view: its client, and the fence and lease token it holds."""

    def __init__(self, client: APIClient, run_id: Any) -> None:
        self.client = client
        self.run_id = str(run_id)
        self.fence: int | None = None
        self.lease_token: str | None = None
        self.resume: dict[str, Any] = {}

    def lease(self, **body) -> Any:
        response = self.client.post(f"/api/v1/runs/{self.run_id}/lease/", body)
        if response.status_code == 200:
            self.fence = response.json()["fence"]
            self.lease_token = response.json()["lease_token"]
            self.resume = response.json()["resume"]
        return response

    def post(self, path: str, body: dict | None = None) -> Any:
        proof = {"fence": self.fence, "lease_token": self.lease_token}
        return self.client.post(f"/api/v1/{path}", {**proof, **(body or {})})

    def run_post(self, what: str, body: dict | None = None) -> Any:
        return self.post(f"runs/{self.run_id}/{what}/", body)

    def propose(self, tool: str, arguments: dict, **extra) -> Any:
        return self.run_post("tool-calls", {"tool": tool, "arguments": arguments, **extra})

    def dispatch(self, call_id: int, **extra) -> Any:
        return self.post(f"tool-calls/{call_id}/dispatch/", extra)

    def send_check(self, call_id: int, attempt: int) -> Any:
        return self.post(f"tool-calls/{call_id}/send-check/", {"attempt": attempt})

    def lookup(self, call_id: int) -> Any:
        return self.post(f"tool-calls/{call_id}/lookups/")

    def receipt(self, call_id: int, **body) -> Any:
        return self.post(f"tool-calls/{call_id}/receipt/", body)

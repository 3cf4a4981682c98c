"""A complete remote agent written with ``agentops.client`` (docs/remote-agents.md).

It refunds one order through the demo sandbox payments service, which in its
non-deduplicating mode would happily refund twice: only the protocol's discipline (dispatch
before calling, reconcile an unknown outcome by key, never blindly send again) keeps it to
exactly one refund, whichever process dies where.

    python -m agentops.demo.remote_agent --register          # once, with an admin token
    python -m agentops.demo.remote_agent --run <run id>      # as often as you like

Environment: ``AGENTOPS_URL`` (default http://127.0.0.1:8000), ``AGENTOPS_TOKEN``,
``SANDBOX_URL`` (default http://127.0.0.1:8765). Imports no Django.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import time
from typing import Any

import httpx

from agentops.client import Client, InvalidState, LeaseLost, RemoteRun, ToolCallInfo

NAME = "remote_refunder"
MANIFEST: dict[str, Any] = {
    "version": "1",
    "input_schema": {
        "type": "object",
        "properties": {
            "order_id": {"type": "string", "pattern": "^ord_[0-9]+$"},
            "amount_cents": {"type": "integer", "minimum": 1},
        },
        "required": ["order_id", "amount_cents"],
    },
    "tools": [
        {
            "name": "refund_payment",
            "description": "Refund part of an order in the payments service.",
            # the service may not deduplicate, but it answers a lookup by key
            "effect": "reconcilable",
            "argument_schema": {
                "type": "object",
                "properties": {
                    "order_id": {"type": "string"},
                    "amount_cents": {"type": "integer", "minimum": 1},
                },
                "required": ["order_id", "amount_cents"],
                "additionalProperties": False,
            },
            "timeout": 5,
            "approval": {
                "when": {"argument": "amount_cents", "op": "gt", "value": 10000},
                "group": "approver",
                "ttl_seconds": 86400,
            },
        }
    ],
}


def say(message: str) -> None:
    print(message, flush=True)


class Refunder:
    def __init__(self, run: RemoteRun, sandbox_url: str, *, hold_after_tool: bool = False):
        self.run = run
        self.sandbox = sandbox_url.rstrip("/")
        self.hold_after_tool = hold_after_tool
        self.state: dict[str, Any] = dict(run.resume.state)

    # the real tool, and its lookup by idempotency key

    def call_refund(self, key: str, arguments: dict[str, Any]) -> tuple[str, Any]:
        """("succeeded" | "failed" | "unknown", result)"""
        try:
            response = httpx.post(
                f"{self.sandbox}/refunds", json={"idempotency_key": key, **arguments}, timeout=5
            )
        except httpx.HTTPError as exc:  # timeout, reset: it may or may not have happened
            return "unknown", f"{type(exc).__name__}: {exc}"
        if response.status_code >= 500:
            return "unknown", f"answered {response.status_code}"
        if response.status_code >= 400:
            return "failed", response.json()
        return "succeeded", response.json()

    def lookup_refund(self, key: str) -> tuple[str, Any]:
        """("found" | "absent" | "unknown", refund)"""
        try:
            response = httpx.get(
                f"{self.sandbox}/refunds", params={"idempotency_key": key}, timeout=5
            )
            body = response.json()
        except (httpx.HTTPError, ValueError) as exc:
            return "unknown", str(exc)  # a failed lookup is NOT absence
        if response.status_code == 200 and body.get("found") is True:
            return "found", body["refunds"][0]
        if response.status_code == 200 and body.get("found") is False:
            return "absent", None
        return "unknown", body

    # the protocol

    def execute(self, call_id: int) -> None:
        dispatch = self.run.dispatch(call_id)
        if not dispatch.go:
            raise SystemExit(f"not dispatched: {dispatch.reason}")
        say(f"dispatching {dispatch.idempotency_key} attempt {dispatch.attempt}")
        outcome, result = self.call_refund(dispatch.idempotency_key, dispatch.arguments)
        say(f"tool returned {outcome}")
        if self.hold_after_tool:
            # for the crash demo: the refund happened, nothing is recorded yet; kill me now
            while True:
                time.sleep(60)
        if outcome == "unknown":
            self.run.receipt(call_id, "unknown", result=result)
            self.reconcile(call_id, dispatch.idempotency_key)
            return
        self.record(call_id, outcome, result, source="agent")

    def record(self, call_id: int, outcome: str, result: Any, *, source: str) -> None:
        if outcome == "succeeded":
            self.state["refund"] = result
        else:
            self.state["refund_failed"] = result
        self.run.receipt(
            call_id,
            outcome,
            result=result,
            external_ref=(result or {}).get("refund_id", "") if outcome == "succeeded" else "",
            source=source,
            state=self.state,
        )

    def reconcile(self, call_id: int, key: str) -> None:
        """An unknown outcome: look the key up, never just send it again."""
        for attempt in range(5):
            found, refund = self.lookup_refund(key)
            say(f"reconciled {key}: {found}")
            if found == "found":
                self.record(call_id, "succeeded", refund, source="reconciliation")
                return
            if found == "absent":
                self.run.receipt(call_id, "absent", source="reconciliation")
                # sent again with the same key, once the first request can no longer land
                while True:
                    try:
                        self.execute(call_id)
                        return
                    except InvalidState:
                        time.sleep(1)
            time.sleep(2**attempt)
        raise SystemExit(f"cannot tell whether {key} happened; leaving it for an operator")

    def advance(self) -> str:
        resume = self.run.resume
        for call in resume.unknown_outcomes:
            self.reconcile(call.id, call.idempotency_key)
        for call in resume.open_tool_calls:
            if call.status in ("proposed", "approved"):
                self.execute(call.id)
        if resume.pending_approvals:
            return "waiting for approval"
        undecided = "refund" not in self.state and "refund_failed" not in self.state
        if undecided and not self.refund_attempted(resume.open_tool_calls):
            order = resume.input
            self.state["plan"] = "refund"
            self.run.step(input={"goal": resume.goal}, output={"plan": "refund"}, state=self.state)
            proposal = self.run.propose(
                "refund_payment",
                {"order_id": order["order_id"], "amount_cents": order["amount_cents"]},
            )
            say(f"proposed: {proposal.decision}")
            if proposal.decision == "awaiting_approval":
                return "waiting for approval"  # the lease is released; a webhook wakes us
            if proposal.decision != "approved":
                self.run.fail(f"refund refused: {proposal.error}")
                return "failed"
            self.execute(proposal.tool_call_id)
        if "refund_failed" in self.state:
            self.run.fail(f"the payments service refused: {self.state['refund_failed']}")
            return "failed"
        self.run.finish({"refund": self.state.get("refund")})
        return "finished"

    @staticmethod
    def refund_attempted(open_calls: list[ToolCallInfo]) -> bool:
        return any(call.tool == "refund_payment" for call in open_calls)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default=os.environ.get("AGENTOPS_URL", "http://127.0.0.1:8000"))
    parser.add_argument("--sandbox", default=os.environ.get("SANDBOX_URL", "http://127.0.0.1:8765"))
    parser.add_argument("--register", action="store_true", help="register the manifest and exit")
    parser.add_argument("--run", help="the run to advance")
    parser.add_argument("--owner", default=f"{socket.gethostname()}:{os.getpid()}")
    parser.add_argument("--wait", type=float, default=60.0, help="wait this long for the lease")
    parser.add_argument("--hold-after-tool", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    token = os.environ.get("AGENTOPS_TOKEN")
    if not token:
        parser.error("set AGENTOPS_TOKEN")
    with Client(args.url, token) as client:
        if args.register:
            client.register_agent(NAME, MANIFEST)
            say(f"registered {NAME}")
            return 0
        if not args.run:
            parser.error("--run is required")
        run = client.lease_when_free(args.run, owner=args.owner, wait=args.wait)
        say(f"leased fence {run.fence}")
        try:
            with run:
                outcome = Refunder(
                    run, args.sandbox, hold_after_tool=args.hold_after_tool
                ).advance()
        except LeaseLost as exc:
            say(f"lease lost: {exc.detail}")
            return 3
        say(outcome)
    return 0


if __name__ == "__main__":
    sys.exit(main())

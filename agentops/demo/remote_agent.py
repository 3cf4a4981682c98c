"""A complete remote agent written with ``agentops.client`` (docs/remote-agents.md).

It refunds one order through the demo sandbox payments service, which in its
non-deduplicating mode would happily refund twice: only the protocol's discipline (dispatch
before calling, the pre-send check, reconcile an unknown outcome by key with a lookup that
began after the landing deadline, never blindly send again) keeps it to exactly one refund,
whichever process dies or freezes where. ``agentops.client`` runs that loop.

    # once, with an admin token: register the manifest, naming the service account (in the
    # agent role) whose tokens drive its runs
    python -m agentops.demo.remote_agent --register --agent-account refunder-bot
    # as often as you like, with a token of that service account
    python -m agentops.demo.remote_agent --run <run id>

Environment: ``AGENTOPS_URL`` (default http://127.0.0.1:8000), ``AGENTOPS_TOKEN``,
``SANDBOX_URL`` (default http://127.0.0.1:8765). Imports no Django.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import time
from collections.abc import Mapping
from typing import Any

import httpx

from agentops.client import (
    Client,
    Executed,
    Found,
    LeaseLost,
    OutcomeUnknown,
    RemoteRun,
    ToolContext,
    ToolFailed,
)
from agentops.demo.cli import demo_main, demo_parser, say

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


class Refunder:
    def __init__(self, run: RemoteRun, sandbox_url: str, *, hold_after_tool: bool = False):
        self.run = run
        self.sandbox = sandbox_url.rstrip("/")
        self.hold_after_tool = hold_after_tool
        self.state: dict[str, Any] = dict(run.resume.state)

    # the real tool, and its lookup by idempotency key

    def refund(self, arguments: Mapping[str, Any], ctx: ToolContext) -> dict[str, Any]:
        """Called by the client after the pre-send check. ``ctx.request`` sends the key, the
        fence and the send deadline as headers, never starts sending after the send deadline,
        and bounds the whole call by the tool's timeout."""
        say(f"dispatching {ctx.idempotency_key} attempt {ctx.attempt}")
        body = {"idempotency_key": ctx.idempotency_key, **arguments}
        try:
            response = ctx.request("POST", f"{self.sandbox}/refunds", json=body)
        except OutcomeUnknown:
            say("tool returned unknown")
            raise
        outcome = "succeeded" if response.status_code < 400 else "failed"
        if response.status_code >= 500:
            outcome = "unknown"
        say(f"tool returned {outcome}")
        if self.hold_after_tool:
            # for the crash demo: the refund happened, nothing is recorded yet; kill me now
            while True:
                time.sleep(60)
        if outcome == "unknown":
            raise OutcomeUnknown(f"answered {response.status_code}")
        if outcome == "failed":
            raise ToolFailed(response.json())
        refund = response.json()
        return {**refund, "external_ref": refund.get("refund_id", "")}

    def would_refund(self, arguments: Mapping[str, Any]) -> dict[str, Any]:
        """A dry run's refund: what it would do. The client calls this instead of ``refund``
        when the dispatch says not to execute; nothing is sent to the payments service."""
        say(f"dry run: would refund {arguments['amount_cents']} to {arguments['order_id']}")
        return {"dry_run": True, "would": "POST /refunds", **arguments}

    def find_refund(self, key: str, arguments: Mapping[str, Any]) -> Found:
        try:
            response = httpx.get(
                f"{self.sandbox}/refunds", params={"idempotency_key": key}, timeout=5
            )
            body = response.json()
        except (httpx.HTTPError, ValueError) as exc:
            found = Found("unknown", detail=str(exc))  # a failed lookup is NOT absence
        else:
            if response.status_code == 200 and body.get("found") is True:
                refund = body["refunds"][0]
                found = Found("found", refund, refund.get("refund_id", ""))
            elif response.status_code == 200 and body.get("found") is False:
                found = Found("absent")
            else:
                found = Found("unknown", detail=str(body))
        say(f"reconciled {key}: {found.outcome}")
        return found

    def new_state(self, outcome: str, result: Any) -> dict[str, Any]:
        self.state["refund" if outcome == "succeeded" else "refund_failed"] = result
        return self.state

    # the protocol: the client runs dispatch -> pre-send check -> tool -> receipt, and on an
    # unknown outcome lookups -> absent -> dispatch again only when the server allows it

    def settle(self, done: Executed) -> str | None:
        if done.outcome in ("succeeded", "failed"):
            return None
        if done.outcome == "needs_attention":
            return "needs a person"  # resend: person, an unsafe outcome: an operator decides
        raise SystemExit(f"cannot tell whether the refund happened: {done.reason or done.outcome}")

    def advance(self) -> str:
        resume = self.run.resume
        opts = {"lookup": self.find_refund, "state": self.new_state}
        for call in resume.unknown_outcomes:  # 1. settle what an earlier process left
            stop = self.settle(self.run.reconcile(call.id, self.refund, **opts))
            if stop:
                return stop
        for call in resume.open_tool_calls:  # 2. e.g. approved while we were away
            if call.status in ("proposed", "approved"):
                done = self.run.execute(call.id, self.refund, simulate=self.would_refund, **opts)
                stop = self.settle(done)
                if stop:
                    return stop
        if resume.pending_approvals:
            return "waiting for approval"
        undecided = "refund" not in self.state and "refund_failed" not in self.state
        if undecided and not any(c.tool == "refund_payment" for c in resume.open_tool_calls):
            order = resume.input
            self.state["plan"] = "refund"  # 3. decide, checkpoint, then act
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
            done = self.run.execute(
                proposal.tool_call_id, self.refund, simulate=self.would_refund, **opts
            )
            stop = self.settle(done)
            if stop:
                return stop
        if "refund_failed" in self.state:
            self.run.fail(f"the payments service refused: {self.state['refund_failed']}")
            return "failed"
        self.run.finish({"refund": self.state.get("refund")})
        return "finished"


def main(argv: list[str] | None = None) -> int:
    parser = demo_parser(__doc__.splitlines()[0])
    parser.add_argument("--run", help="the run to advance")
    parser.add_argument("--owner", default=f"{socket.gethostname()}:{os.getpid()}")
    parser.add_argument("--wait", type=float, default=60.0, help="wait this long for the lease")
    parser.add_argument("--hold-after-tool", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    def advance(client: Client) -> int:
        if not args.run:
            parser.error("--run is required")
        run = client.lease_when_free(args.run, owner=args.owner, wait=args.wait)
        say(f"leased fence {run.fence}{' (a dry run)' if run.dry_run else ''}")
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

    return demo_main(parser, args, name=NAME, manifest=MANIFEST, work=advance)


if __name__ == "__main__":
    sys.exit(main())

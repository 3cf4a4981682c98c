"""A remote agent whose tool MCP clients call through the gateway (docs/mcp.md, "A remote
agent's tools"): it refunds through the demo sandbox payments service, in its own process,
and ``agentops.client.mcp.serve`` carries out each call an MCP client made of it — proposed
under the recorded call's id, gated by the manifest's policy, dispatched, sent after the
pre-send check, its receipt recorded, an unknown outcome looked up by key.

    # once, with an admin token: register the manifest, naming the service account (in the
    # agent role) whose tokens drive its runs
    python -m agentops.demo.mcp_refunder --register --agent-account refunder-bot
    # the gateway must offer it: AGENTOPS_MCP_REMOTE_AGENTS=mcp_refunder (for runmcp)
    # then, with a token of that service account, for as long as calls may come
    python -m agentops.demo.mcp_refunder

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

from agentops.client import Client, Found, OutcomeUnknown, ToolContext, ToolFailed
from agentops.client.mcp import serve
from agentops.demo.cli import demo_main, demo_parser, say
from agentops.demo.remote_agent import MANIFEST as REFUNDER

NAME = "mcp_refunder"
# the refunder's tool and approval policy (above 100.00 a person approves); the input of a
# gateway run is an empty object
MANIFEST: dict[str, Any] = {
    "version": "1",
    "input_schema": {"type": "object"},
    "tools": REFUNDER["tools"],
}


def refund_tools(
    sandbox: str, *, hold_after_tool: bool = False
) -> tuple[dict[str, Any], dict[str, Any]]:
    sandbox = sandbox.rstrip("/")

    def refund_payment(arguments: Mapping[str, Any], ctx: ToolContext) -> dict[str, Any]:
        # after the pre-send check; ctx.request never starts sending after the send deadline
        body = {"idempotency_key": ctx.idempotency_key, **arguments}
        response = ctx.request("POST", f"{sandbox}/refunds", json=body)
        if response.status_code >= 500:
            raise OutcomeUnknown(f"answered {response.status_code}")
        if response.status_code >= 400:
            raise ToolFailed(response.json())
        refund = response.json()
        say(f"refunded {ctx.idempotency_key}")
        while hold_after_tool:  # for the crash test: refunded, nothing recorded; kill me now
            time.sleep(60)
        return {**refund, "external_ref": refund.get("refund_id", "")}

    def find_refund(key: str, arguments: Mapping[str, Any]) -> Found:
        try:
            response = httpx.get(f"{sandbox}/refunds", params={"idempotency_key": key}, timeout=5)
            body = response.json()
        except (httpx.HTTPError, ValueError) as exc:
            return Found("unknown", detail=str(exc))  # a failed lookup is not absence
        if response.status_code == 200 and body.get("found") is True:
            refund = body["refunds"][0]
            return Found("found", refund, refund.get("refund_id", ""))
        if response.status_code == 200 and body.get("found") is False:
            return Found("absent")
        return Found("unknown", detail=str(body))

    return {"refund_payment": refund_payment}, {"refund_payment": find_refund}


def main(argv: list[str] | None = None) -> int:
    parser = demo_parser(__doc__.splitlines()[0])
    parser.add_argument("--owner", default=f"{socket.gethostname()}:{os.getpid()}")
    parser.add_argument("--idle", type=float, default=3600.0, help="a run with no call ends")
    parser.add_argument("--poll", type=float, default=0.5, help="seconds between looks")
    parser.add_argument("--hold-after-tool", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    def serve_calls(client: Client) -> int:
        tools, lookups = refund_tools(args.sandbox, hold_after_tool=args.hold_after_tool)
        say("serving")
        serve(
            client,
            NAME,
            tools,
            lookups=lookups,
            idle_seconds=args.idle,
            poll_seconds=args.poll,
            owner=args.owner,
            say=say,
        )
        return 0

    return demo_main(parser, args, name=NAME, manifest=MANIFEST, work=serve_calls)


if __name__ == "__main__":
    sys.exit(main())

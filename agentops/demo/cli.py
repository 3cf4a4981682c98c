"""The command line the demo's remote agents share (``remote_agent``, ``mcp_refunder``): where
agentops and the sandbox are, ``--register`` (the manifest, and the account whose tokens drive
its runs), and a client from ``AGENTOPS_TOKEN``. Imports no Django."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from typing import Any

from agentops.client import BadPauseSpec, Client


def say(message: str) -> None:
    print(message, flush=True)


def demo_parser(description: str) -> argparse.ArgumentParser:
    """The arguments every demo agent takes; the agent adds its own after them."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--url", default=os.environ.get("AGENTOPS_URL", "http://127.0.0.1:8000"))
    parser.add_argument("--sandbox", default=os.environ.get("SANDBOX_URL", "http://127.0.0.1:8765"))
    parser.add_argument("--register", action="store_true", help="register the manifest and exit")
    parser.add_argument(
        "--agent-account",
        help="with --register: the username (agent role) whose tokens drive the agent's runs",
    )
    return parser


def demo_main(
    parser: argparse.ArgumentParser,
    args: argparse.Namespace,
    *,
    name: str,
    manifest: dict[str, Any],
    work: Callable[[Client], int],
) -> int:
    """Connect with ``AGENTOPS_TOKEN``; with ``--register``, register ``manifest`` as ``name``
    and exit, else hand the client to ``work``. A malformed ``AGENTOPS_PAUSE_AT`` is one line
    on stderr and exit 2."""
    token = os.environ.get("AGENTOPS_TOKEN")
    if not token:
        parser.error("set AGENTOPS_TOKEN")
    try:
        client = Client(args.url, token)
    except BadPauseSpec as exc:
        print(exc, file=sys.stderr)
        return 2
    with client:
        if args.register:
            registered = dict(manifest)
            if args.agent_account:
                registered["owner"] = args.agent_account
            client.register_agent(name, registered)
            say(f"registered {name}")
            return 0
        return work(client)

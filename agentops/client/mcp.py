"""Serving MCP clients' calls of this agent's manifest tools (docs/mcp.md, "A remote
agent's tools"). Imports no Django.

When the gateway offers a remote agent's tools (``AGENTOPS_MCP_REMOTE_AGENTS``), an MCP
client's ``tools/call`` of one is recorded in a run of the agent and the run is signalled
(``mcp.call``); the agent's process carries it out here, under the run's lease, through the
ordinary protocol:

1. an unknown outcome an earlier process left is reconciled, an approved call executed;
2. each recorded call not yet proposed is proposed under its own ``client_call_id``
   (``mcp-<n>``: proposed again by a successor, it answers the same call — never a second),
   then executed (dispatch, pre-send check, the tool, the receipt, lookups);
3. with nothing left, the run waits for the next ``mcp.call`` signal with its lease released
   (and finishes after ``idle_seconds`` with no call).

``serve(client, agent, tools, lookups=...)`` is the whole loop for a process: it leases each
of the agent's gateway runs that waits for a process and serves it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import httpx

from agentops.client import (
    ApiError,
    Client,
    LeaseLost,
    LookupFn,
    RemoteRun,
    Tool,
)

SIGNAL = "mcp.call"  # what the gateway sends a run for each call it records
IDLE = {"idle": True}  # the default of a wait that timed out with no call


@dataclass(frozen=True)
class McpCall:
    """A ``tools/call`` the gateway recorded in the run. ``tool_call_id`` None: not proposed
    yet — propose it under ``call_id``."""

    position: int
    call_id: str
    tool: str
    arguments: dict[str, Any]
    tool_call_id: int | None
    tool_call_status: str | None

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> McpCall:
        return cls(
            position=data["position"],
            call_id=data["call_id"],
            tool=data["tool"],
            arguments=dict(data.get("arguments") or {}),
            tool_call_id=data.get("tool_call_id"),
            tool_call_status=data.get("tool_call_status"),
        )


def waiting_runs(client: Client, agent: str) -> list[str]:
    """The agent's gateway runs that wait for a process, oldest first (the owner's token)."""
    return [str(run["id"]) for run in client.request("GET", f"agents/{agent}/mcp-runs/")]


def recorded_calls(run: RemoteRun) -> list[McpCall]:
    """The run's recorded MCP calls, in order (only the lease holder reads them)."""
    data = run.client.request("GET", f"runs/{run.run_id}/mcp-calls/")
    return [McpCall.from_json(item) for item in data]


def serve_run(
    run: RemoteRun,
    tools: Mapping[str, Tool],
    *,
    lookups: Mapping[str, LookupFn] | None = None,
    idle_seconds: float = 3600.0,
    say: Callable[[str], None] = lambda message: None,
) -> str:
    """Carry out the run's MCP calls under the lease ``run`` holds; how it ended:
    ``waiting_for_calls`` / ``waiting_for_approval`` / ``paused`` (the lease is released),
    ``finished``
    (idle), ``needs_attention`` (a person resolves an unknown outcome), ``undecided`` (a
    lookup could not tell: the lease is kept — release it or try again). ``LeaseLost``
    propagates: stop."""
    lookups = lookups or {}
    resume = run.resume
    for call in resume.unknown_outcomes:  # 1. what an earlier process left
        done = run.reconcile(call.id, tools[call.tool], lookup=lookups.get(call.tool))
        say(f"reconciled {call.client_call_id or call.id}: {done.outcome}")
        if done.outcome in ("needs_attention", "undecided"):
            return done.outcome
    for call in resume.open_tool_calls:
        if call.status in ("proposed", "approved"):
            done = run.execute(call.id, tools[call.tool], lookup=lookups.get(call.tool))
            say(f"executed {call.client_call_id or call.id}: {done.outcome}")
            if done.outcome in ("needs_attention", "undecided"):
                return done.outcome
    idle = resume.last_wait is not None and resume.last_wait.timed_out
    while True:
        new = [call for call in recorded_calls(run) if call.tool_call_id is None]
        if not new and idle:
            run.finish({"idle": True})
            return "finished"
        for call in new:  # 2. in the order they were recorded, one at a time
            proposal = run.propose(call.tool, call.arguments, call_id=call.call_id)
            say(f"proposed {call.call_id}: {proposal.decision}")
            if proposal.decision == "awaiting_approval":
                return "waiting_for_approval"
            if proposal.decision == "paused":  # the run's principal may not use the tool
                return "paused"
            if proposal.decision == "approved" and proposal.tool_call_id is not None:
                done = run.execute(
                    proposal.tool_call_id, tools[call.tool], lookup=lookups.get(call.tool)
                )
                say(f"executed {call.call_id}: {done.outcome}")
                if done.outcome in ("needs_attention", "undecided"):
                    return done.outcome
        if new:
            idle = False  # calls came after the idle wait: the run goes on
        # 3. nothing left: wait for the next call (one already signalled ends it at once)
        wait = run.wait_for_signal(SIGNAL, timeout=idle_seconds, default=IDLE)
        if wait.waiting:
            return "waiting_for_calls"
        idle = wait.outcome is not None and wait.outcome.timed_out


def serve(
    client: Client,
    agent: str,
    tools: Mapping[str, Tool],
    *,
    lookups: Mapping[str, LookupFn] | None = None,
    idle_seconds: float = 3600.0,
    poll_seconds: float = 0.5,
    owner: str = "",
    until: Callable[[], bool] = lambda: False,
    say: Callable[[str], None] = lambda message: None,
) -> None:
    """Serve the agent's gateway runs until ``until()``: lease each that waits for a
    process, carry out its calls (``serve_run``), look again every ``poll_seconds``."""
    while not until():
        try:
            run_ids = waiting_runs(client, agent)
        except (ApiError, httpx.HTTPError) as exc:
            say(f"cannot list the runs waiting: {exc}")
            run_ids = []
        for run_id in run_ids:
            try:
                run = client.lease(run_id, owner=owner)
            except ApiError:
                continue  # another process took it (LeaseHeld), or it no longer waits
            try:
                with run:
                    outcome = serve_run(
                        run, tools, lookups=lookups, idle_seconds=idle_seconds, say=say
                    )
                    if outcome == "undecided":
                        run.release()  # the next pass reconciles it again
            except LeaseLost as exc:
                say(f"lease lost on {run_id}: {exc}")
                continue
            except (ApiError, httpx.HTTPError) as exc:
                # the record keeps where it stands: the lease expires, the next pass resumes
                say(f"run {run_id}: {exc}")
                continue
            say(f"run {run_id}: {outcome}")
        time.sleep(poll_seconds)

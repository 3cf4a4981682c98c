"""What the framework adapters share: a framework's tool call routed through a leased run.

A framework (Pydantic AI, the OpenAI Agents SDK) decides a tool call; ``CallRouter.route``
makes it a durable call of the run — proposed with the run's idempotency key, gated by the
run's approval policy, dispatched, sent after the pre-send check, its receipt recorded, an
unknown outcome looked up by key (``RemoteRun.execute`` / ``reconcile``, docs/remote-agents.md).

Frameworks call their tools again when they resume (Pydantic AI re-runs the unanswered calls
of the history's last response; the OpenAI adapter replays recorded model responses), so a
call is first matched against the calls the run already has: by tool and arguments among
those recorded after the checkpoint of the model response that made it (``window_after``),
each adopted at most once per process. A completed one answers with its recorded result, an
open one is dispatched or reconciled, never proposed a second time.

What the framework needs to resume with the same decision (its message history, its recorded
model responses) is kept in the run's conversation history store, not in the run's state:
each checkpoint appends only the messages that are new (``ConversationHistory``), and the
checkpoint's step names the stored messages it rests on — one write of a few numbers that
commits with the decision, whatever the length of the conversation.

Imports no Django and no framework.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Mapping, Sequence
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

from . import (
    Executed,
    HistoryConflict,
    LookupFn,
    RemoteRun,
    Tool,
    ToolCallInfo,
    ToolContext,
)

__all__ = [
    "Admitted",
    "CallRouter",
    "ConversationHistory",
    "Outcome",
    "OutcomeUndecided",
    "Routed",
    "current_call",
]

CHECKPOINT = {"checkpoint": "model_response"}  # a checkpoint step's input
HISTORY = "history"  # in a checkpoint step's output: the stored messages it rests on

CURRENT_CALL: ContextVar[ToolContext | None] = ContextVar("agentops_current_call", default=None)


def current_call() -> ToolContext:
    """Inside a tool routed through agentops: the call's ``ToolContext`` — its
    ``idempotency_key`` (send it to the downstream), ``headers()``, ``check_send()`` and
    ``request()`` (one HTTP request never started after the send deadline)."""
    ctx = CURRENT_CALL.get()
    if ctx is None:
        raise RuntimeError("current_call() is only available inside a tool agentops dispatched")
    return ctx


def call_with_context(body: Tool, arguments: Mapping[str, Any], ctx: ToolContext) -> Any:
    token = CURRENT_CALL.set(ctx)
    try:
        return body(arguments, ctx)
    finally:
        CURRENT_CALL.reset(token)


@dataclass(frozen=True)
class Outcome:
    """How ``run_agent`` ended: ``finished`` (``output``: the agent's; the run was finished
    with it) or ``parked`` (the run waits for a person — ``detail`` says for what — and the
    lease is released: exit, and run the agent again when the webhook says it was decided)."""

    status: str
    output: Any = None
    detail: str = ""


@dataclass(frozen=True)
class Admitted:
    """A call the run let through its gate and that is still to be carried out."""

    tool_call_id: int
    unknown: bool = False  # an earlier process may have sent it: look it up first


@dataclass(frozen=True)
class Routed:
    """How a routed call ended for the framework. ``status``: ``succeeded`` (``result`` is
    the tool's, recorded), ``failed`` (the tool answered with a definite failure: ``result``),
    ``refused`` (the policy, an approver or a changed precondition refused it: ``detail``),
    ``parked`` (the run waits for a person — an approval, an unknown outcome nobody can look
    up — and the lease is released: the framework must stop and the process exit)."""

    status: str
    result: Any = None
    detail: str = ""
    tool_call_id: int | None = None


def canonical(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), default=str)


class CallRouter:
    """Routes one process's framework tool calls through the run it leased. Thread-safe:
    the protocol allows one open call at a time, so calls are routed one after another."""

    def __init__(self, run: RemoteRun) -> None:
        self.run = run
        self.next_seq = run.resume.next_seq
        # calls recorded after this step belong to the model response being acted on
        self.window_after = 0
        self.adopted: set[int] = set()
        self.parked: Routed | None = None
        self.history = ConversationHistory(run)
        self._lock = threading.RLock()

    # checkpoints

    def checkpoint(
        self, make_messages: Callable[[int], Sequence[Mapping[str, Any]]], output: Any
    ) -> int:
        """A ``decided`` step before acting on a model response: ``make_messages(seq)`` is
        the framework's whole message list at this response (JSON objects), from which a
        new process resumes with the same decision (the model is not asked again); ``seq``
        is the step's. What is new in it is appended to the run's history store, and the
        step's output names the stored messages (``history``). Sent with that ``seq``, so a
        retry after a lost answer records it once. Returns the seq."""
        with self._lock:
            seq = self.next_seq
            kept = self.history.save(make_messages(seq))
            self.run.step(
                input=dict(CHECKPOINT),
                output={**dict(output), HISTORY: kept},
                seq=seq,
            )
            self.next_seq = seq + 1
            self.window_after = seq
        return seq

    def last_checkpoint(self) -> tuple[int, list[Any]] | None:
        """The run's latest checkpoint step: its seq and the messages it rests on, read
        back from the history store (this process's ``history`` then continues from them);
        None if the run has none (a new run, or one checkpointed in its state by an older
        version of the adapter)."""
        steps = [
            step
            for step in self.run.resume.steps
            if step.get("input") == CHECKPOINT
            and isinstance(step.get("output"), dict)
            and HISTORY in step["output"]
        ]
        if not steps:
            return None
        return steps[-1]["seq"], self.history.load(steps[-1]["output"][HISTORY])

    def resume_from(self, seq: int) -> None:
        """Act on a model response checkpointed earlier at ``seq`` (a new process)."""
        self.window_after = seq

    # routing

    def route(
        self,
        tool: str,
        arguments: Mapping[str, Any],
        body: Tool,
        *,
        lookup: LookupFn | None = None,
        framework_call_id: str = "",
    ) -> Routed:
        """The whole life of one call: matched or proposed, gated, executed with the
        dispatch / pre-send check / receipt protocol, an unknown outcome looked up.
        ``body(arguments, ctx)`` performs the side effect with ``ctx.idempotency_key``
        (``current_call()`` inside it gives the same ``ctx``). ``LeaseLost`` propagates."""
        with self._lock:
            admitted = self.admit(tool, arguments, framework_call_id=framework_call_id)
            if isinstance(admitted, Routed):
                return admitted
            return self.carry_out(admitted, body, lookup=lookup)

    def admit(
        self, tool: str, arguments: Mapping[str, Any], *, framework_call_id: str = ""
    ) -> Routed | Admitted:
        """The gate alone: the call's outcome if the run already has one (``Routed``), or
        the open call to ``carry_out`` (proposed now if the run has none: the policy
        decides). ``Routed("parked")``: the run waits for a person, the lease is released."""
        with self._lock:
            if self.parked is not None:
                return self.parked  # the lease is already released: ask nothing more
            admitted = self._admit(tool, dict(arguments), framework_call_id)
            return self._park(admitted) if isinstance(admitted, Routed) else admitted

    def carry_out(
        self, admitted: Admitted, body: Tool, *, lookup: LookupFn | None = None
    ) -> Routed:
        """Dispatch an admitted call, send it after the pre-send check, record its receipt;
        an unknown outcome is looked up by key (``lookup``), sent again only when the server
        allows it."""

        def traced(args: Mapping[str, Any], ctx: ToolContext) -> Any:
            return call_with_context(body, args, ctx)

        with self._lock:
            if self.parked is not None:
                return self.parked
            drive = self.run.reconcile if admitted.unknown else self.run.execute
            done = drive(admitted.tool_call_id, traced, lookup=lookup)
            return self._park(self._executed(admitted.tool_call_id, done))

    def _park(self, routed: Routed) -> Routed:
        if routed.status == "parked":
            self.parked = routed
            self.run.stop_heartbeat()
        return routed

    def _admit(
        self, tool: str, arguments: dict[str, Any], framework_call_id: str
    ) -> Routed | Admitted:
        done = self._recorded(tool, arguments)
        if done is not None:
            return done
        call = self._open(tool, arguments)
        if call is not None:
            if call.status == "awaiting_approval":
                return Routed("parked", detail="waiting for approval", tool_call_id=call.id)
            return Admitted(call.id, unknown=call.status == "unknown")
        # the framework's own call id (issue 27, item 2): the server answers a second
        # propose of the same id with the same call, so the matching above is a fallback
        proposal = self.run.propose(tool, arguments, call_id=_usable_id(framework_call_id))
        self.next_seq = max(self.next_seq, proposal.step_seq + 1)
        if proposal.tool_call_id is not None:
            self.adopted.add(proposal.step_seq)
        if proposal.decision == "awaiting_approval":
            return Routed(
                "parked", detail="waiting for approval", tool_call_id=proposal.tool_call_id
            )
        if proposal.decision == "paused":
            return Routed("parked", detail=proposal.error, tool_call_id=proposal.tool_call_id)
        if proposal.decision == "refused" or proposal.tool_call_id is None:
            return Routed("refused", detail=proposal.error)
        # approved (dispatch it), or a fork's family already sent this key: look it up
        return Admitted(proposal.tool_call_id, unknown=proposal.decision == "unknown")

    def _executed(self, tool_call_id: int, done: Executed) -> Routed:
        if done.outcome in ("succeeded", "failed"):
            return Routed(done.outcome, done.result, tool_call_id=tool_call_id)
        if done.outcome == "not_dispatched":
            # rejected by an approver, cancelled by a changed precondition or a retired tool
            return Routed("refused", detail=done.reason, tool_call_id=tool_call_id)
        if done.outcome == "needs_attention":
            return Routed("parked", detail="needs a person", tool_call_id=tool_call_id)
        # the lookups could not tell: nothing may be assumed, and nothing sent again
        raise OutcomeUndecided(f"tool call {tool_call_id}: {done.reason or done.outcome}")

    # matching what the run already has (see the module's docstring)

    def _recorded(self, tool: str, arguments: dict[str, Any]) -> Routed | None:
        candidates = []
        for step in self.run.resume.steps:
            seq = step["seq"]
            if step["kind"] != "tool_call" or seq <= self.window_after or seq in self.adopted:
                continue
            name = str((step.get("input") or {}).get("tool", ""))
            if name == tool or name.endswith("/" + tool):
                candidates.append(step)
        if not candidates:
            return None
        # a recorded step's arguments are masked where the tool declares sensitive fields:
        # the same arguments first, else the first call of that tool after the checkpoint
        wanted = canonical(arguments)
        same = [
            s for s in candidates if canonical((s.get("input") or {}).get("arguments")) == wanted
        ]
        step = (same or candidates)[0]
        self.adopted.add(step["seq"])
        if step["status"] == "completed":
            return Routed("succeeded", step.get("output"))
        return Routed("refused", detail=step.get("error") or "the call failed")

    def _open(self, tool: str, arguments: dict[str, Any]) -> ToolCallInfo | None:
        wanted = canonical(arguments)
        for call in self.run.resume.open_tool_calls:
            # an open call is the run's latest (one at a time): never left behind unsettled
            if call.step_seq in self.adopted or call.tool != tool:
                continue
            if canonical(call.arguments) == wanted:
                self.adopted.add(call.step_seq)
                return call
        return None


class OutcomeUndecided(Exception):
    """Lookups could not tell whether the call acted: the call stays unknown on the server
    (an operator sees it); this process stops without assuming anything."""


def _usable_id(framework_call_id: str) -> str | None:
    """The framework's call id when the server accepts it as a client call id (1-200
    printable ASCII characters, no spaces), else None (the call is matched as before)."""
    value = framework_call_id or ""
    if 0 < len(value) <= 200 and value.isascii() and value.isprintable() and " " not in value:
        return value
    return None


class HistoryLost(Exception):
    """A checkpoint names messages the run's history store no longer has: the framework's
    history cannot be rebuilt (nothing is guessed; the record says what was done)."""


class ConversationHistory:
    """A framework's message list kept in the run's history store (``POST/GET
    /runs/{id}/messages/``: beside the record, not in it). ``save`` appends only the
    messages past the part already stored and unchanged, and answers the seqs the whole
    list is made of, as ``[first, last]`` ranges; ``load`` rebuilds the list from them.

    Messages a process appended and then died before its checkpoint named them stay in the
    store, unnamed and unread; a successor appends after them (``after_seq`` is learnt from
    the store's ``history_conflict`` answer), so an append never overwrites anything. The
    store's limits apply: ``MessageTooLarge``, ``HistoryFull`` (docs/remote-agents.md)."""

    def __init__(self, run: RemoteRun) -> None:
        self.run = run
        self.seqs: list[int] = []  # the stored seq of each message of the list
        self.messages: list[Any] = []  # the list as stored
        self.last_seq = 0  # the store's last seq as far as this process knows

    def load(self, ranges: Sequence[Sequence[int]]) -> list[Any]:
        seqs = [seq for first, last in ranges for seq in range(int(first), int(last) + 1)]
        wanted, found = set(seqs), {}
        if seqs:
            for item in self.run.client.messages(self.run.run_id, after_seq=min(seqs) - 1):
                self.last_seq = max(self.last_seq, item["seq"])
                if item["seq"] in wanted:
                    found[item["seq"]] = item["message"]
        missing = wanted - set(found)
        if missing:
            raise HistoryLost(f"the run's history has no message {min(missing)}")
        self.seqs, self.messages = seqs, [found[seq] for seq in seqs]
        return list(self.messages)

    def save(self, messages: Sequence[Mapping[str, Any]]) -> list[list[int]]:
        messages = [dict(message) for message in messages]
        same = 0
        for stored, message in zip(self.messages, messages, strict=False):
            if canonical(stored) != canonical(message):
                break
            same += 1
        seqs = self.seqs[:same]
        if messages[same:]:
            first, last = self._append(messages[same:])
            seqs += range(first, last + 1)
        self.seqs, self.messages = seqs, messages
        return _ranges(seqs)

    def _append(self, messages: list[dict[str, Any]]) -> tuple[int, int]:
        try:
            answer = self.run.append_messages(messages, after_seq=self.last_seq)
        except HistoryConflict as exc:
            # messages this process has not seen (a predecessor's, never named by a
            # checkpoint): append after them
            self.last_seq = int(exc.body["last_seq"])
            answer = self.run.append_messages(messages, after_seq=self.last_seq)
        self.last_seq = answer["last_seq"]
        return answer["first_seq"], answer["last_seq"]


def _ranges(seqs: Sequence[int]) -> list[list[int]]:
    ranges: list[list[int]] = []
    for seq in seqs:
        if ranges and ranges[-1][1] == seq - 1:
            ranges[-1][1] = seq
        else:
            ranges.append([seq, seq])
    return ranges

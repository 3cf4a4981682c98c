"""A small typed client for the agentops API, for remote agents and scripts.

Standalone: it needs only ``httpx`` and imports nothing from Django or the rest of agentops,
so an agent process can vendor this one file. See docs/remote-agents.md for a complete agent.

    client = Client("https://agentops.example.com", token=os.environ["AGENTOPS_TOKEN"])
    with client.lease(run_id, owner="refunder-1") as run:   # heartbeats in the background
        for call in run.resume.unknown_outcomes:             # reconcile before anything new
            ...
        proposal = run.propose("refund", {"order_id": "ord_1", "amount_cents": 500})
        if proposal.decision == "approved":
            # dispatch -> pre-send check -> refund(arguments, ctx) -> receipt; an unknown
            # outcome is looked up by key and sent again only when the server allows it
            done = run.execute(proposal.tool_call_id, refund, lookup=find_refund)
        wait = run.wait_for_signal("customer_replied", timeout=3 * 86400)
        if wait.waiting:                                     # the lease is released: exit; the
            return                                           # run.wait_ended webhook wakes us
        run.finish({"refunded": True, "reply": wait.outcome.output})

Errors are raised as ``ApiError`` subclasses named after the API's error codes; a
``LeaseLost`` means this process must stop advancing the run at once (another process took
over, or an operator paused or terminated it).

``AGENTOPS_PAUSE_AT=dispatching|before_send[:<n>]`` freezes this process (SIGSTOP) right after
the n-th dispatch answer, or right after the n-th pre-send check passed, for tests and the
chaos harness (DESIGN §9). The hosted worker's other points are accepted and inert here; a
malformed value is ``BadPauseSpec`` (one line) when the ``Client`` is made.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from types import TracebackType
from typing import Any

import httpx

__all__ = [
    "ApiError",
    "BadPauseSpec",
    "Client",
    "ClientCallIdConflict",
    "HistoryConflict",
    "HistoryFull",
    "InvalidPatch",
    "MessageTooLarge",
    "PatchNotApplicable",
    "PatchTestFailed",
    "StateVersionMismatch",
    "Dispatch",
    "DispatchTooEarly",
    "Executed",
    "Found",
    "LookupTooEarly",
    "NotSent",
    "OutcomeUnknown",
    "ReconcileRequired",
    "SendDeadlinePassed",
    "ToolContext",
    "ToolFailed",
    "LeaseHeld",
    "LeaseLost",
    "LeaseNotYours",
    "Proposal",
    "RemoteRun",
    "Resume",
    "ToolCallInfo",
    "Wait",
    "WaitOutcome",
    "WebhookVerificationError",
    "verify_webhook",
]

# the server holds a long poll (?wait=) at most this long
LONG_POLL_MAX = 30
# a long poll answered sooner than this while the run is still parked was not held (capped)
LONG_POLL_MIN_HOLD = 1.0
# a run waiting for a person or an event (what wait_for_run waits to see end)
PARKED = ("waiting_approval", "waiting_event", "needs_attention", "paused")

SIGNATURE_HEADER = "Agentops-Webhook-Signature"
TIMESTAMP_HEADER = "Agentops-Webhook-Timestamp"
EVENT_HEADER = "Agentops-Webhook-Event"
DELIVERY_HEADER = "Agentops-Webhook-Id"


# --- errors ------------------------------------------------------------------------------------


class ApiError(Exception):
    """An error answer: ``code`` is the API's machine code (see docs/api.md)."""

    def __init__(
        self,
        status: int,
        code: str,
        detail: str,
        fields: Mapping[str, list[str]] | None = None,
        body: Mapping[str, Any] | None = None,
    ) -> None:
        super().__init__(f"{status} {code}: {detail}")
        self.status = status
        self.code = code
        self.detail = detail
        self.fields = dict(fields or {})
        # the whole answer: some codes carry values to act on (resend_after, latest_lookup)
        self.body = dict(body or {})

    @property
    def resend_after(self) -> datetime | None:
        return _parse_time(self.body.get("resend_after"))


class ValidationError(ApiError):
    pass


def _retry_after(exc: ApiError, default: float = 1.0) -> float:
    """When to try again after a 429: its ``retry_after`` field, else ``default``."""
    try:
        return max(float(exc.body.get("retry_after", default)), 0.05)
    except (TypeError, ValueError):
        return default


class NotFound(ApiError):
    pass


class PermissionDenied(ApiError):
    pass


class NotAuthenticated(ApiError):
    pass


class InvalidState(ApiError):
    pass


class LeaseHeld(ApiError):
    """Another process holds the run's lease."""


class LeaseLost(ApiError):
    """This process no longer holds the lease: stop, write nothing more."""


class LeaseNotYours(LeaseLost):
    """The write named a fence this process's claim did not get (another principal's or
    process's lease): stop, write nothing more."""


class BudgetExhausted(ApiError):
    pass


class Throttled(ApiError):
    pass


class SendDeadlinePassed(ApiError):
    """The pre-send check refused: the dispatch's send deadline passed. Do not send."""


class LookupRequired(ValidationError):
    pass


class LookupTooEarly(InvalidState):
    """The lookup began before the original request could no longer land: begin another
    after ``resend_after``."""


class LookupSuperseded(InvalidState):
    pass


class ReconcileRequired(InvalidState):
    """An unknown outcome: look it up (or let a person resolve it) before dispatching."""


class DispatchTooEarly(InvalidState):
    """The original request may still land until ``resend_after``."""


class ClientCallIdConflict(InvalidState):
    """The ``call_id`` was proposed before with another tool or other arguments (the call it
    names: ``exc.body["tool_call"]``)."""


class InvalidPatch(ValidationError):
    """Not an RFC 6902 patch."""


class PatchTestFailed(InvalidState):
    """A ``test`` operation of the patch failed: nothing changed (``exc.body["state_version"]``)."""


class PatchNotApplicable(InvalidState):
    """The patch does not apply to the state as it is: nothing changed."""


class StateVersionMismatch(InvalidState):
    """The state is not at the ``state_version`` the patch was made against."""


class MessageTooLarge(ValidationError):
    pass


class HistoryFull(InvalidState):
    pass


class HistoryConflict(InvalidState):
    """Another message came after ``after_seq`` (``exc.body["last_seq"]``)."""


_ERRORS: dict[str, type[ApiError]] = {
    "client_call_id_conflict": ClientCallIdConflict,
    "invalid_patch": InvalidPatch,
    "patch_test_failed": PatchTestFailed,
    "patch_not_applicable": PatchNotApplicable,
    "state_version_mismatch": StateVersionMismatch,
    "message_too_large": MessageTooLarge,
    "history_full": HistoryFull,
    "history_conflict": HistoryConflict,
    "send_deadline_passed": SendDeadlinePassed,
    "lookup_required": LookupRequired,
    "lookup_too_early": LookupTooEarly,
    "lookup_superseded": LookupSuperseded,
    "reconcile_required": ReconcileRequired,
    "dispatch_too_early": DispatchTooEarly,
    "validation_error": ValidationError,
    "unknown_agent": ValidationError,
    "not_found": NotFound,
    "permission_denied": PermissionDenied,
    "not_authenticated": NotAuthenticated,
    "invalid_state": InvalidState,
    "lease_held": LeaseHeld,
    "lease_lost": LeaseLost,
    "lease_not_yours": LeaseNotYours,
    "budget_exhausted": BudgetExhausted,
    "throttled": Throttled,
    # a server process holding all the long polls it may: read again after retry_after
    "long_polls_busy": Throttled,
}


# --- what the protocol returns ------------------------------------------------------------------


@dataclass(frozen=True)
class ToolCallInfo:
    id: int
    step_seq: int
    tool: str
    status: str
    idempotency_key: str
    arguments: dict[str, Any]
    attempt_count: int
    dispatched_at: str | None
    approval: int | None
    last_error: str = ""
    client_call_id: str = ""  # the id given at propose (``call_id``), "" if none

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> ToolCallInfo:
        return cls(
            id=data["id"],
            step_seq=data["step_seq"],
            tool=data["tool"],
            status=data["status"],
            idempotency_key=data["idempotency_key"],
            arguments=dict(data.get("arguments") or {}),
            attempt_count=data.get("attempt_count", 0),
            dispatched_at=data.get("dispatched_at"),
            approval=data.get("approval"),
            last_error=data.get("last_error", ""),
            client_call_id=data.get("client_call_id") or "",
        )


@dataclass(frozen=True)
class WaitOutcome:
    """How a wait ended. ``ended_by``: ``signal`` (``output`` is its payload), ``answer``
    (the answer), ``timer`` (``{"until": ...}``) or ``timeout`` (``timed_out``; ``output`` is
    the wait's declared default)."""

    step_seq: int
    kind: str  # signal | timer | question
    ended_by: str
    timed_out: bool
    output: Any
    signal_id: int | None = None
    question_id: int | None = None
    answered_by: str | None = None

    @classmethod
    def from_json(cls, step_seq: int, output: Any, data: Mapping[str, Any]) -> WaitOutcome:
        return cls(
            step_seq=step_seq,
            kind=data["kind"],
            ended_by=data["ended_by"],
            timed_out=data["timed_out"],
            output=output,
            signal_id=data.get("signal_id"),
            question_id=data.get("question_id"),
            answered_by=data.get("answered_by"),
        )


@dataclass(frozen=True)
class Wait:
    """What beginning a wait answered. ``waiting``: the run is parked and the lease is
    released — stop, and lease the run again when the ``run.wait_ended`` webhook arrives
    (its resume packet has the outcome). Otherwise the wait ended at once (the signal was
    already there, the time had come): ``outcome`` says how, and the lease is still yours."""

    step_seq: int
    kind: str
    waiting: bool
    deadline: str | None
    question_id: int | None
    outcome: WaitOutcome | None

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Wait:
        outcome = data.get("outcome")
        return cls(
            step_seq=data["step_seq"],
            kind=data["kind"],
            waiting=data["waiting"],
            deadline=data.get("deadline"),
            question_id=data.get("question"),
            outcome=WaitOutcome.from_json(data["step_seq"], data.get("output"), outcome)
            if outcome
            else None,
        )


@dataclass(frozen=True)
class Resume:
    """Where the run stands: everything a new process needs before deciding anything.
    ``waits`` are the finished waits, oldest first (``last_wait``: the latest one)."""

    run_id: str
    agent_version: str
    goal: str
    input: dict[str, Any]
    state: dict[str, Any]
    steps: list[dict[str, Any]]
    open_tool_calls: list[ToolCallInfo]
    unknown_outcomes: list[ToolCallInfo]
    pending_approvals: list[dict[str, Any]]
    migrated_from: str | None = None
    migrations: list[dict[str, Any]] = field(default_factory=list)
    waits: list[WaitOutcome] = field(default_factory=list)
    # a dry run: no tool that is not read may be executed (``RemoteRun.execute`` refuses)
    dry_run: bool = False
    # the state's version (a JSON patch made against it passes ``state_version``)
    state_version: int = 0
    server_next_seq: int | None = None

    @property
    def last_wait(self) -> WaitOutcome | None:
        return self.waits[-1] if self.waits else None

    @property
    def next_seq(self) -> int:
        """The number the run's next step gets (pass it as ``seq`` to make a retry safe):
        the server's ``next_seq``, or worked out from the steps of an older server's packet."""
        if self.server_next_seq is not None:
            return self.server_next_seq
        seqs = [s["seq"] for s in self.steps] + [c.step_seq for c in self.open_tool_calls]
        return max(seqs, default=0) + 1

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Resume:
        steps = list(data.get("steps") or [])
        return cls(
            run_id=data["run"],
            agent_version=data["agent_version"],
            goal=data.get("goal", ""),
            input=dict(data.get("input") or {}),
            state=dict(data.get("state") or {}),
            steps=steps,
            open_tool_calls=[ToolCallInfo.from_json(c) for c in data.get("open_tool_calls", [])],
            unknown_outcomes=[ToolCallInfo.from_json(c) for c in data.get("unknown_outcomes", [])],
            pending_approvals=list(data.get("pending_approvals") or []),
            migrated_from=data.get("migrated_from"),
            migrations=list(data.get("migrations") or []),
            dry_run=bool(data.get("dry_run", False)),
            state_version=int(data.get("state_version") or 0),
            server_next_seq=data.get("next_seq"),
            waits=[
                WaitOutcome.from_json(step["seq"], step.get("output"), step["wait"])
                for step in steps
                if step.get("wait")
            ],
        )


@dataclass(frozen=True)
class Proposal:
    """``approved``: dispatch it now. ``awaiting_approval``: the lease is released; exit and
    come back when the ``approval.decided`` webhook arrives. ``refused``: a failed step."""

    decision: str
    step_seq: int
    tool_call_id: int | None
    approval_id: int | None
    error: str
    # the same call_id proposed before: its call, as it stands (decision may then also be
    # succeeded, failed, rejected, cancelled or unknown)
    replayed: bool = False
    call_id: str = ""


@dataclass(frozen=True)
class Dispatch:
    """``go``: call the tool now with ``idempotency_key`` and ``arguments`` (an approver may
    have edited them) — after ``RemoteRun.send_check``. Otherwise ``reason`` says why not (the
    call's status changed). ``send_deadline`` / ``landing_deadline`` are the server's (database
    time); ``send_by`` / ``finish_by`` the same bounds on this process's monotonic clock,
    counted from *before* the dispatch request was sent, so they can only end earlier."""

    go: bool
    idempotency_key: str
    arguments: dict[str, Any]
    attempt: int
    status: str
    reason: str
    tool_call_id: int = 0
    fence: int | None = None
    replayed: bool = False
    dispatched_at: datetime | None = None
    send_deadline: datetime | None = None
    landing_deadline: datetime | None = None
    timeout: float | None = None
    send_by: float | None = None
    finish_by: float | None = None
    # ``execute`` false: a dry run's call of a tool that is not read — do not call the tool
    dry_run: bool = False
    execute: bool = True


@dataclass(frozen=True)
class Lookup:
    """A reconciliation lookup begun on the server (``number``, in database time). Name it in
    the receipt. ``absent_allows_resend`` false: it began before ``resend_after`` (the
    landing deadline), so an ``absent`` from it would be refused."""

    tool_call_id: int
    number: int
    started_at: datetime
    resend_after: datetime | None
    absent_allows_resend: bool
    begun: float  # this process's monotonic clock, before the request was sent

    def seconds_until_resend(self) -> float:
        """How long from now until a lookup begun then can report absent (server times
        compared with each other, never with this host's clock)."""
        if self.resend_after is None:
            return 0.0
        wait = (self.resend_after - self.started_at).total_seconds()
        return max(0.0, wait - (time.monotonic() - self.begun))


@dataclass(frozen=True)
class Found:
    """What a lookup by key answered: ``found`` (with the result), ``absent`` (reliably not
    there), or ``unknown`` (the lookup failed or cannot tell — never absence)."""

    outcome: str
    result: Any = None
    external_ref: str = ""
    detail: str = ""


@dataclass(frozen=True)
class Executed:
    """How ``RemoteRun.execute`` / ``reconcile`` ended. ``outcome``: ``succeeded`` /
    ``failed`` (recorded, ``source`` says by whom), ``not_dispatched`` (``reason``),
    ``needs_attention`` (the run waits for a person: stop), or ``undecided`` (the lookups
    could not tell; the call stays unknown)."""

    outcome: str
    result: Any = None
    source: str = ""
    reason: str = ""
    run_status: str = "running"


# --- what a tool function gets ------------------------------------------------------------------


class ToolFailed(Exception):
    """Raise from a tool function: the tool answered with a definite failure."""

    def __init__(self, result: Any = None) -> None:
        super().__init__(str(result))
        self.result = result


class OutcomeUnknown(Exception):
    """Raise from a tool function: it may or may not have acted (timeout, reset, 5xx)."""


class NotSent(Exception):
    """The request did not leave (the send deadline or the total budget passed first)."""


@dataclass(frozen=True)
class ToolContext:
    """What a tool function gets besides the arguments: the key, the fence and the send
    deadline travel with the request (``headers()``) for a downstream that checks them;
    ``check_send()`` refuses once the request may no longer leave, ``remaining()`` is what
    is left of the tool's total timeout. ``request()`` does both for one HTTP request."""

    tool_call_id: int
    idempotency_key: str
    attempt: int
    fence: int | None
    send_deadline: datetime | None
    timeout: float
    send_by: float | None
    finish_by: float | None

    def remaining(self) -> float:
        if self.finish_by is None:
            return self.timeout
        return max(0.0, self.finish_by - time.monotonic())

    def check_send(self) -> None:
        """Raise ``NotSent`` once the request may no longer leave. Call it as late as
        possible before the first byte is written."""
        now = time.monotonic()
        if self.send_by is not None and now >= self.send_by:
            raise NotSent(f"the send deadline passed {now - self.send_by:.3f}s ago: not sent")
        if self.finish_by is not None and now >= self.finish_by:
            raise NotSent("the tool's total timeout passed before the request was sent")

    def headers(self) -> dict[str, str]:
        headers = {"Idempotency-Key": self.idempotency_key}
        if self.fence is not None:
            headers["X-Agentops-Fence"] = str(self.fence)
        if self.send_deadline is not None:
            headers["X-Agentops-Send-Deadline"] = self.send_deadline.astimezone(UTC).isoformat()
        return headers

    def request(self, method: str, url: str, **kwargs: Any) -> httpx.Response:
        """One HTTP request inside the tool's total timeout, connection set-up included
        (httpx's own timeout bounds each phase separately), whose first byte is never
        written after the send deadline. ``NotSent`` if it did not leave; ``OutcomeUnknown``
        for a timeout or a transport error after it may have left. The answer is returned
        as it is (the tool decides what a status means)."""
        self.check_send()
        sent = False

        def trace(event: str, info: dict[str, Any]) -> None:
            nonlocal sent
            if not event.endswith(".started"):
                return
            left = self.remaining()
            if left <= 0:
                raise httpx.TimeoutException(f"{method} {url}: the total timeout passed")
            if event.endswith("send_request_headers.started"):
                self.check_send()  # the last moment before the request's first byte
                sent = True
            if "timeout" in info and event.startswith("connection."):
                info["timeout"] = left if info["timeout"] is None else min(info["timeout"], left)
            outgoing = info.get("request")
            if outgoing is not None:
                outgoing.extensions["timeout"] = dict.fromkeys(
                    ("connect", "read", "write", "pool"), left
                )

        headers = {**self.headers(), **kwargs.pop("headers", {})}
        extensions = {**kwargs.pop("extensions", {}), "trace": trace}
        try:
            with httpx.Client(timeout=httpx.Timeout(self.remaining())) as http:
                outgoing = http.build_request(
                    method, url, headers=headers, extensions=extensions, **kwargs
                )
                return http.send(outgoing)
        except NotSent:
            raise
        except httpx.HTTPError as exc:
            if not sent:
                raise NotSent(f"{method} {url}: {type(exc).__name__} before sending") from exc
            raise OutcomeUnknown(f"{method} {url}: {type(exc).__name__}: {exc}") from exc


Tool = Callable[[Mapping[str, Any], ToolContext], Any]
LookupFn = Callable[[str, Mapping[str, Any]], Found]


# --- pauses for tests and the chaos harness (DESIGN §9) --------------------------------------

# the contract's points (runs/faults.py): the client pauses at the two that are its own
_BOUNDARIES = (
    "claimed",
    "decided",
    "approval_requested",
    "dispatching",
    "before_send",
    "tool_call",
    "receipt_recorded",
    "step_completed",
    "run_finished",
)
CLIENT_PAUSE_POINTS = ("dispatching", "before_send")


class BadPauseSpec(ValueError):
    pass


def parse_pause_spec(value: str | None) -> tuple[str, int] | None:
    """``AGENTOPS_PAUSE_AT=<boundary>[:<n>]`` as (boundary, n); None when unset."""
    if value is None or value.strip() == "":
        return None
    boundary, _, count = value.strip().partition(":")
    if boundary not in _BOUNDARIES:
        raise BadPauseSpec(
            f"AGENTOPS_PAUSE_AT={value!r}: unknown boundary {boundary!r} "
            f"(expected one of {', '.join(_BOUNDARIES)}, optionally followed by :N)"
        )
    if count == "":
        return boundary, 1
    if not count.isdigit() or int(count) < 1:
        raise BadPauseSpec(
            f"AGENTOPS_PAUSE_AT={value!r}: the occurrence must be a positive integer"
        )
    return boundary, int(count)


class _Pauses:
    def __init__(self, spec: tuple[str, int] | None) -> None:
        self.spec = spec
        self.seen = 0
        self.lock = threading.Lock()

    def point(self, boundary: str) -> None:
        if self.spec is None or self.spec[0] != boundary:
            return
        with self.lock:
            self.seen += 1
            hit = self.seen == self.spec[1]
        if hit:
            sys.stderr.write(f"AGENTOPS_PAUSE_AT: freezing process {os.getpid()} at {boundary}\n")
            sys.stderr.flush()
            os.kill(os.getpid(), signal.SIGSTOP)  # execution resumes here on SIGCONT


def _parse_time(value: Any) -> datetime | None:
    if not value:
        return None
    return datetime.fromisoformat(str(value).replace("Z", "+00:00"))


# --- the client ---------------------------------------------------------------------------------


class Client:
    def __init__(
        self,
        base_url: str,
        token: str,
        *,
        timeout: float = 10.0,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        # first: a malformed value stops the process before it does anything
        self.pauses = _Pauses(parse_pause_spec(os.environ.get("AGENTOPS_PAUSE_AT")))
        self._http = httpx.Client(
            base_url=base_url.rstrip("/") + "/api/v1/",
            headers={"Authorization": f"Bearer {token}", "Accept": "application/json"},
            timeout=timeout,
            transport=transport,
        )

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def request(
        self,
        method: str,
        path: str,
        *,
        json: Any = None,
        params: Mapping[str, Any] | None = None,
        headers: Mapping[str, str] | None = None,
        timeout: float | None = None,
    ) -> Any:
        """One request; an error answer raises the ``ApiError`` for its code. Nothing is
        retried here: a write may have been applied when its answer was lost, and only the
        caller knows whether sending it again is safe."""
        extra: dict[str, Any] = {} if timeout is None else {"timeout": timeout}
        response = self._http.request(
            method, path.lstrip("/"), json=json, params=params, headers=headers, **extra
        )
        return self._answer(response)

    @staticmethod
    def _answer(response: httpx.Response) -> Any:
        """The answer's JSON; an error answer raises the ``ApiError`` for its code."""
        if response.status_code >= 400:
            try:
                body = response.json()
            except ValueError:
                body = {}
            code = body.get("code", "server_error") if isinstance(body, dict) else "server_error"
            detail = body.get("detail", response.text[:500]) if isinstance(body, dict) else ""
            error = _ERRORS.get(code, ApiError)
            if not isinstance(body, dict):
                body = {}
            raise error(response.status_code, code, detail, body.get("fields"), body)
        return response.json() if response.content else None

    # runs, approvals, agents

    def create_run(
        self,
        agent: str,
        input: Mapping[str, Any] | None = None,
        *,
        goal: str = "",
        budget: Mapping[str, Any] | None = None,
        idempotency_key: str | None = None,
    ) -> dict[str, Any]:
        body: dict[str, Any] = {"agent": agent, "goal": goal, "input": dict(input or {})}
        if budget:
            body["budget"] = dict(budget)
        headers = {"Idempotency-Key": idempotency_key} if idempotency_key else None
        return self.request("POST", "runs/", json=body, headers=headers)

    def _long_poll(self, path: str, wait: float | None) -> Any:
        if not wait:
            return self.request("GET", path)
        seconds = max(0, min(int(wait), LONG_POLL_MAX))
        # the server holds the answer up to ``seconds``: the read may take that long
        base = self._http.timeout.read or 10.0
        return self.request("GET", path, params={"wait": seconds}, timeout=seconds + base)

    def get_run(self, run_id: str, *, wait: float | None = None) -> dict[str, Any]:
        """The run. ``wait`` (seconds, at most 30): while it is parked for a person or an
        event (``waiting_approval``, ``waiting_event``, ``needs_attention``, ``paused``), the
        server answers as soon as its status changes, or after ``wait`` seconds."""
        return self._long_poll(f"runs/{run_id}/", wait)

    def wait_for_run(
        self, run_id: str, *, timeout: float = 3600.0, parked: Sequence[str] = PARKED
    ) -> dict[str, Any]:
        """Long-poll the run until it is no longer ``parked`` (an approval decided, a wait
        ended: it is ``queued`` for an agent process) or ``timeout`` seconds passed; returns
        the run as last read. No webhook receiver needed, one request slot held at a time."""
        deadline = time.monotonic() + timeout
        while True:
            started = time.monotonic()
            left = max(deadline - started, 0)
            try:
                run = self.get_run(run_id, wait=min(LONG_POLL_MAX, left))
            except Throttled as exc:
                # the server holds all the long polls it may (long_polls_busy) or this
                # client asked too often: wait as told, then read again
                time.sleep(min(_retry_after(exc), max(deadline - time.monotonic(), 0)))
                if time.monotonic() >= deadline:
                    return self.get_run(run_id)
                continue
            if run["status"] not in parked or time.monotonic() >= deadline:
                return run
            if time.monotonic() - started < LONG_POLL_MIN_HOLD:
                # answered at once while still parked (this token's long polls are capped):
                # never a busy loop of reads
                time.sleep(min(LONG_POLL_MIN_HOLD, max(deadline - time.monotonic(), 0)))

    def get_approval(self, approval_id: int, *, wait: float | None = None) -> dict[str, Any]:
        """An approval (for principals that may read approvals). ``wait`` (at most 30): while
        it is pending, the server answers as soon as it is decided, or after ``wait``."""
        return self._long_poll(f"approvals/{approval_id}/", wait)

    def messages(self, run_id: str, *, after_seq: int = 0) -> Iterator[dict[str, Any]]:
        """The run's conversation history after ``after_seq``, oldest first, page by page
        (the agent's own account only): each ``{"seq", "message", ...}``."""
        return self._by_seq(f"runs/{run_id}/messages/", after_seq)

    def _by_seq(self, path: str, after_seq: int) -> Iterator[dict[str, Any]]:
        """Every item of a list paged by ``after_seq`` / ``last_seq`` (events, messages)."""
        while True:
            page = self.request("GET", path, params={"after_seq": after_seq, "limit": 500})
            yield from page["results"]
            if not page["next"]:
                return
            after_seq = page["last_seq"]

    def events(self, run_id: str, *, after_seq: int = 0) -> Iterator[dict[str, Any]]:
        """Every event after ``after_seq``, page by page."""
        return self._by_seq(f"runs/{run_id}/events/", after_seq)

    def signal(
        self,
        run_id: str,
        name: str,
        payload: Any = None,
        *,
        idempotency_key: str | None = None,
    ) -> dict[str, Any]:
        body = {"name": name, "payload": payload, "idempotency_key": idempotency_key or ""}
        return self.request("POST", f"runs/{run_id}/signals/", json=body)

    def decide_approval(
        self,
        approval_id: int,
        decision: str,
        *,
        comment: str = "",
        arguments: Mapping[str, Any] | None = None,
    ) -> dict[str, Any]:
        body: dict[str, Any] = {"decision": decision, "comment": comment}
        if arguments is not None:
            body["arguments"] = dict(arguments)
        return self.request("POST", f"approvals/{approval_id}/decision/", json=body)

    def register_agent(self, name: str, manifest: Mapping[str, Any]) -> dict[str, Any]:
        return self.request("PUT", f"agents/{name}/", json=dict(manifest))

    # the lease protocol

    def lease(self, run_id: str, *, owner: str = "") -> RemoteRun:
        """Claim the run's lease (``LeaseHeld`` when another process has it)."""
        data = self.request("POST", f"runs/{run_id}/lease/", json={"owner": owner})
        return RemoteRun(self, data)

    def lease_when_free(
        self, run_id: str, *, owner: str = "", wait: float = 60.0, poll: float = 0.5
    ) -> RemoteRun:
        """Claim the lease, waiting up to ``wait`` seconds for a dead holder's to expire."""
        deadline = time.monotonic() + wait
        while True:
            try:
                return self.lease(run_id, owner=owner)
            except LeaseHeld:
                if time.monotonic() >= deadline:
                    raise
                time.sleep(poll)


class RemoteRun:
    """The run while this process holds its lease. Every write carries the fence and the
    lease token the claim returned (a secret of this process: never logged, never sent to a
    tool)."""

    def __init__(self, client: Client, data: Mapping[str, Any]) -> None:
        self.client = client
        self.run_id: str = str(data["run"])
        self.fence: int = data["fence"]
        self._lease_token: str = data["lease_token"]
        self.lease_expires_at: str = data["lease_expires_at"]
        self.lease_ttl: float = float(data.get("lease_ttl_seconds", 30.0))
        self.resume = Resume.from_json(data["resume"])
        self.requested_action = ""
        self.lost: ApiError | None = None
        self._stop = threading.Event()
        self._beater: threading.Thread | None = None

    @property
    def dry_run(self) -> bool:
        """A dry run: ``execute`` calls no tool that is not read (the guarantee is this
        process's: the server can only tell it not to)."""
        return self.resume.dry_run

    def _post(self, path: str, body: Mapping[str, Any] | None = None) -> Any:
        proof = {"fence": self.fence, "lease_token": self._lease_token}
        return self.client.request("POST", path, json={**proof, **(body or {})})

    # keeping the lease

    def heartbeat(self) -> str:
        """Extend the lease; returns the operator's request (``pause``/``terminate``) if any."""
        data = self._post(f"runs/{self.run_id}/lease/heartbeat/")
        self.lease_expires_at = data["lease_expires_at"]
        self.requested_action = data["requested_action"]
        return self.requested_action

    def start_heartbeat(self, interval: float | None = None) -> None:
        """Heartbeat in a background thread every third of the lease's time to live. When
        the lease is lost, ``lost`` is set and the next write raises ``LeaseLost`` anyway."""
        every = interval or max(self.lease_ttl / 3, 0.2)

        def beat() -> None:
            while not self._stop.wait(every):
                try:
                    self.heartbeat()
                except LeaseLost as exc:
                    self.lost = exc
                    return
                except (httpx.HTTPError, ApiError):
                    continue  # a missed beat; the next one may get through before expiry

        self._beater = threading.Thread(target=beat, daemon=True, name=f"lease-{self.run_id}")
        self._beater.start()

    def stop_heartbeat(self) -> None:
        self._stop.set()
        if self._beater is not None:
            self._beater.join()

    def __enter__(self) -> RemoteRun:
        self.start_heartbeat()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop_heartbeat()

    def release(self) -> None:
        self._post(f"runs/{self.run_id}/lease/release/")

    # advancing the run

    def step(
        self,
        *,
        input: Any = None,
        output: Any = None,
        state: Mapping[str, Any] | None = None,
        cost: float | str = 0,
        tokens: int = 0,
        seq: int | None = None,
    ) -> dict[str, Any]:
        """Checkpoint a decision (and the new state) before acting on it. With ``seq`` (the
        number this step should get, e.g. ``resume.next_seq``) sending it again after a lost
        answer returns the step already recorded instead of recording a second one."""
        body: dict[str, Any] = {
            "input": input if input is not None else {},
            "output": output,
            "cost": str(cost),
            "tokens": tokens,
        }
        if state is not None:
            body["state"] = dict(state)
        if seq is not None:
            body["seq"] = seq
        return self._post(f"runs/{self.run_id}/steps/", body)

    def propose(
        self,
        tool: str,
        arguments: Mapping[str, Any],
        *,
        precondition: str = "",
        call_id: str | None = None,
    ) -> Proposal:
        """Propose a call; the tool's policy decides. ``call_id``: your framework's own id for
        the call (1-200 printable ASCII characters, no spaces), unique in the run. Proposed
        again — a retry, or a successor replaying the framework's history — it answers the
        call first proposed under it (``replayed``), never a second one; with another tool or
        other arguments it raises ``ClientCallIdConflict``."""
        body: dict[str, Any] = {
            "tool": tool,
            "arguments": dict(arguments),
            "precondition": precondition,
        }
        if call_id:
            body["client_call_id"] = call_id
        response = self.client._http.post(
            f"runs/{self.run_id}/tool-calls/",
            json={"fence": self.fence, "lease_token": self._lease_token, **body},
        )
        data = self.client._answer(response)
        call = data.get("tool_call") or {}
        return Proposal(
            decision=data["decision"],
            step_seq=data["step_seq"],
            tool_call_id=call.get("id"),
            approval_id=data.get("approval"),
            error=data.get("error", ""),
            replayed=response.status_code == 200,
            call_id=call.get("client_call_id") or "",
        )

    # the state, patched; the conversation history (non-authoritative)

    def patch_state(
        self, patch: Sequence[Mapping[str, Any]], *, state_version: int | None = None
    ) -> dict[str, Any]:
        """Apply an RFC 6902 JSON Patch to the run's state (all operations or none):
        ``[{"op": "add", "path": "/notes/-", "value": "..."}]``. ``state_version``: the version
        the patch was made against (``resume.state_version``, then each answer's), else
        ``StateVersionMismatch``; a failed ``test`` op is ``PatchTestFailed``, a path that is
        not there ``PatchNotApplicable``. Returns ``{"state", "state_version"}``."""
        body: dict[str, Any] = {
            "fence": self.fence,
            "lease_token": self._lease_token,
            "patch": [dict(op) for op in patch],
        }
        if state_version is not None:
            body["state_version"] = state_version
        return self.client.request("POST", f"runs/{self.run_id}/state/", json=body)

    def append_messages(
        self, messages: Sequence[Any], *, after_seq: int | None = None
    ) -> dict[str, Any]:
        """Append to the run's conversation history (not the record: for rebuilding your
        framework's message history on resume). ``after_seq``: the last seq you know of
        (``HistoryConflict`` if another came since; a retry of a recorded append is answered
        without storing twice). Returns ``{"first_seq", "last_seq", "total_bytes", ...}``."""
        body: dict[str, Any] = {"messages": list(messages)}
        if after_seq is not None:
            body["after_seq"] = after_seq
        return self._post(f"runs/{self.run_id}/messages/", body)

    def messages(self, *, after_seq: int = 0) -> list[Any]:
        """The run's conversation history (the messages themselves), oldest first."""
        return [m["message"] for m in self.client.messages(self.run_id, after_seq=after_seq)]

    # durable waits (docs/waits.md): the run parks with no lease; exit, and lease it again
    # when the run.wait_ended webhook arrives

    def _wait(self, body: dict[str, Any], seq: int | None) -> Wait:
        if seq is not None:
            body["seq"] = seq
        wait = Wait.from_json(self._post(f"runs/{self.run_id}/waits/", body))
        if wait.waiting:
            self.stop_heartbeat()  # the lease is released: nothing left to keep alive
        return wait

    def wait_for_signal(
        self,
        name: str,
        *,
        timeout: float | None = None,
        default: Any = None,
        seq: int | None = None,
    ) -> Wait:
        """Wait for the signal ``name`` (one sent before the wait began counts). ``timeout``
        seconds (None: for ever) then ends it with ``default``."""
        return self._wait(
            {"kind": "signal", "name": name, "timeout_seconds": timeout, "default": default}, seq
        )

    def sleep(self, seconds: float, *, seq: int | None = None) -> Wait:
        """A durable timer: the run wakes after ``seconds``, whatever happens to processes."""
        return self._wait({"kind": "timer", "seconds": seconds}, seq)

    def sleep_until(self, until: datetime | str, *, seq: int | None = None) -> Wait:
        """A durable timer until a time (a timezone-aware datetime or an ISO 8601 string)."""
        when = until.isoformat() if isinstance(until, datetime) else until
        return self._wait({"kind": "timer", "until": when}, seq)

    def ask(
        self,
        text: str,
        *,
        choices: Sequence[str] | None = None,
        group: str = "operator",
        ttl_seconds: int = 24 * 3600,
        default: Any = None,
        seq: int | None = None,
    ) -> Wait:
        """Ask the people in ``group`` (they are emailed a link and see it in the console);
        the outcome is the first valid answer, or ``default`` after ``ttl_seconds``."""
        body: dict[str, Any] = {
            "kind": "question",
            "text": text,
            "choices": list(choices) if choices is not None else None,
            "group": group,
            "ttl_seconds": ttl_seconds,
            "default": default,
        }
        return self._wait(body, seq)

    def dispatch(self, tool_call_id: int, *, precondition: str = "") -> Dispatch:
        """Mark the call ``dispatching`` *before* calling the tool (a repeated request with
        the same fence gets the original dispatch and its deadlines). The local budgets start
        before the request is sent: they can only end before the server's deadlines."""
        started = time.monotonic()
        data = self._post(f"tool-calls/{tool_call_id}/dispatch/", {"precondition": precondition})
        dispatched_at = _parse_time(data.get("dispatched_at"))
        send_deadline = _parse_time(data.get("send_deadline"))
        timeout = data.get("timeout_seconds")
        send_by = finish_by = None
        if data["go"] and dispatched_at is not None and send_deadline is not None:
            send_by = started + (send_deadline - dispatched_at).total_seconds()
        if data["go"] and timeout is not None:
            finish_by = started + float(timeout)
        dispatch = Dispatch(
            go=data["go"],
            idempotency_key=data["idempotency_key"],
            arguments=dict(data["arguments"] or {}),
            attempt=data["attempt"],
            status=data["tool_call"]["status"],
            reason=data["reason"],
            tool_call_id=tool_call_id,
            fence=data.get("fence"),
            replayed=data.get("replayed", False),
            dispatched_at=dispatched_at,
            send_deadline=send_deadline,
            landing_deadline=_parse_time(data.get("landing_deadline")),
            timeout=float(timeout) if timeout is not None else None,
            send_by=send_by,
            finish_by=finish_by,
            dry_run=bool(data.get("dry_run", False)),
            execute=bool(data.get("execute", True)),
        )
        if dispatch.go:
            self.client.pauses.point("dispatching")
        return dispatch

    def send_check(self, dispatch: Dispatch) -> ToolContext:
        """The pre-send check, immediately before the tool call: the server confirms in one
        query that this fence still holds the run, the call is still this dispatch and its
        send deadline has not passed. ``SendDeadlinePassed`` / ``LeaseLost`` /
        ``InvalidState``: do not send. Returns the tool's context, its send budget tightened
        by what the server said was left (counted from before this request)."""
        asked = time.monotonic()
        data = self._post(
            f"tool-calls/{dispatch.tool_call_id}/send-check/", {"attempt": dispatch.attempt}
        )
        send_by = asked + float(data["send_seconds_left"])
        if dispatch.send_by is not None:
            send_by = min(send_by, dispatch.send_by)
        ctx = ToolContext(
            tool_call_id=dispatch.tool_call_id,
            idempotency_key=dispatch.idempotency_key,
            attempt=dispatch.attempt,
            fence=self.fence,
            send_deadline=_parse_time(data["send_deadline"]),
            timeout=dispatch.timeout or 0.0,
            send_by=send_by,
            finish_by=dispatch.finish_by,
        )
        self.client.pauses.point("before_send")
        return ctx

    def begin_lookup(self, tool_call_id: int) -> Lookup:
        """Record on the server that a lookup of the call's key begins now — before looking
        it up. Name its ``number`` in the receipt."""
        begun = time.monotonic()
        data = self._post(f"tool-calls/{tool_call_id}/lookups/")
        return Lookup(
            tool_call_id=tool_call_id,
            number=data["lookup"],
            started_at=_parse_time(data["started_at"]),
            resend_after=_parse_time(data.get("resend_after")),
            absent_allows_resend=data["absent_allows_resend"],
            begun=begun,
        )

    def receipt(
        self,
        tool_call_id: int,
        outcome: str,
        *,
        result: Any = None,
        external_ref: str = "",
        source: str = "agent",
        state: Mapping[str, Any] | None = None,
        lookup: int | None = None,
    ) -> dict[str, Any]:
        """``succeeded``/``failed`` (the tool answered), ``unknown`` (timeout, reset, 5xx),
        ``not_sent`` (the pre-send check refused: the request never left), or, with
        ``source="reconciliation"`` and the ``lookup`` number, what a lookup by key found:
        ``succeeded``, ``failed`` or ``absent``. The answer's ``run_status`` says whether to
        go on (``running``)."""
        body: dict[str, Any] = {
            "outcome": outcome,
            "source": source,
            "result": result,
            "external_ref": external_ref,
        }
        if lookup is not None:
            body["lookup"] = lookup
        if state is not None:
            body["state"] = dict(state)
        return self._post(f"tool-calls/{tool_call_id}/receipt/", body)

    # the whole loop (docs/remote-agents.md)

    def execute(
        self,
        tool_call_id: int,
        tool: Tool,
        *,
        lookup: LookupFn | None = None,
        state: Callable[[str, Any], Mapping[str, Any] | None] | None = None,
        precondition: str = "",
        max_lookups: int = 5,
        max_sends: int = 3,
        simulate: Callable[[dict[str, Any]], Any] | None = None,
    ) -> Executed:
        """Dispatch the call, pass the pre-send check, call ``tool(arguments, ctx)`` and
        record its outcome; an unknown one is reconciled (``reconcile``). ``tool`` returns
        the result (a dict with ``refund_id``-like ``external_ref`` if any), raises
        ``ToolFailed`` for a definite failure, and ``OutcomeUnknown`` (or anything else) when
        it cannot tell; it should send ``ctx.headers()`` and call ``ctx.check_send()`` just
        before its request leaves (``ctx.request`` does both). ``state(outcome, result)``
        gives the run's new state to record with the receipt. ``LeaseLost`` propagates:
        stop advancing the run.

        In a dry run (``resume.dry_run``; the dispatch answers ``execute: false``) ``tool`` is
        never called: ``simulate(arguments)`` says what it would do (by default, that it was
        not executed), recorded as simulated (docs/remote-agents.md, "Dry runs")."""
        return self._drive(
            tool_call_id,
            tool,
            lookup,
            state,
            precondition=precondition,
            dispatch_first=True,
            max_lookups=max_lookups,
            max_sends=max_sends,
            simulate=simulate,
        )

    def reconcile(
        self,
        tool_call_id: int,
        tool: Tool,
        *,
        lookup: LookupFn | None = None,
        state: Callable[[str, Any], Mapping[str, Any] | None] | None = None,
        max_lookups: int = 5,
        max_sends: int = 3,
    ) -> Executed:
        """An unknown outcome (e.g. from ``resume.unknown_outcomes``): begin a lookup, look the
        key up with ``lookup(key, arguments)``, record what it found; after an accepted
        ``absent``, dispatch again with the same key (waiting out the landing deadline when
        the server says ``lookup_too_early`` or ``dispatch_too_early``). A tool with no
        lookup is dispatched again only if the server allows it (read, deduplicating
        downstream, an operator's "dispatch again")."""
        return self._drive(
            tool_call_id,
            tool,
            lookup,
            state,
            precondition="",
            dispatch_first=False,
            max_lookups=max_lookups,
            max_sends=max_sends,
        )

    def _drive(
        self,
        tool_call_id: int,
        tool: Tool,
        lookup: LookupFn | None,
        state: Callable[[str, Any], Mapping[str, Any] | None] | None,
        *,
        precondition: str,
        dispatch_first: bool,
        max_lookups: int,
        max_sends: int,
        simulate: Callable[[dict[str, Any]], Any] | None = None,
    ) -> Executed:
        send = dispatch_first
        sends = 0
        key, arguments = "", {}
        while True:
            if send:
                sends += 1
                dispatch = self._dispatch_when_allowed(tool_call_id, precondition)
                if not dispatch.go:
                    return Executed("not_dispatched", reason=dispatch.reason)
                key, arguments = dispatch.idempotency_key, dispatch.arguments
                outcome, result, ref = self._send(dispatch, tool, simulate)
                if outcome in ("succeeded", "failed"):
                    return self._record(tool_call_id, outcome, result, ref, "agent", state, None)
                answer = self.receipt(tool_call_id, outcome, result=result)
                if answer.get("run_status", "running") != "running":
                    return Executed("needs_attention", result, run_status=answer["run_status"])
            if not key:
                key, arguments = self._unknown_call(tool_call_id)
            if lookup is None:
                # nothing to look up: the server decides whether the same key may go again
                if sends >= max_sends:
                    return Executed("undecided", reason="sent too often without an outcome")
                send = True
                continue
            found = self._look_up(tool_call_id, key, arguments, lookup, state, max_lookups)
            if found is not None:
                return found
            if sends >= max_sends:
                return Executed("undecided", reason="absent again after too many sends")
            send = True  # an accepted absent: the same key again

    def _unknown_call(self, tool_call_id: int) -> tuple[str, dict[str, Any]]:
        # the key and the real arguments, from the resume packet
        for info in self.resume.open_tool_calls:
            if info.id == tool_call_id:
                return info.idempotency_key, dict(info.arguments)
        raise ValueError(f"tool call {tool_call_id} is not an open call of this lease")

    def _dispatch_when_allowed(self, tool_call_id: int, precondition: str) -> Dispatch:
        for _ in range(3):
            try:
                return self.dispatch(tool_call_id, precondition=precondition)
            except DispatchTooEarly as exc:
                # the original may still land: wait until it cannot (a short server wait)
                time.sleep(min(max(float(exc.body.get("wait_seconds", 1.0)), 0.05), 60.0))
        return self.dispatch(tool_call_id, precondition=precondition)

    def _send(
        self, dispatch: Dispatch, tool: Tool, simulate: Callable[[dict[str, Any]], Any] | None
    ) -> tuple[str, Any, str]:
        """(outcome, result, external_ref): succeeded / failed / unknown / not_sent."""
        if not dispatch.execute:
            # a dry run: the tool is never called, whatever the caller passed
            if simulate is None:
                return "succeeded", {"dry_run": True, "executed": False}, ""
            try:
                return "succeeded", simulate(dict(dispatch.arguments)), ""
            except ToolFailed as exc:
                return "failed", exc.result, ""
        try:
            ctx = self.send_check(dispatch)
        except SendDeadlinePassed as exc:
            return "not_sent", exc.detail, ""
        try:
            result = tool(dispatch.arguments, ctx)
        except ToolFailed as exc:
            return "failed", exc.result, ""
        except NotSent as exc:
            return "not_sent", str(exc), ""
        except Exception as exc:  # it may or may not have acted: reconcile, never assume
            return "unknown", f"{type(exc).__name__}: {exc}", ""
        ref = result.get("external_ref", "") if isinstance(result, dict) else ""
        return "succeeded", result, str(ref or "")

    def _record(
        self,
        tool_call_id: int,
        outcome: str,
        result: Any,
        external_ref: str,
        source: str,
        state: Callable[[str, Any], Mapping[str, Any] | None] | None,
        lookup: int | None,
    ) -> Executed:
        new_state = state(outcome, result) if state is not None else None
        answer = self.receipt(
            tool_call_id,
            outcome,
            result=result,
            external_ref=external_ref,
            source=source,
            state=new_state,
            lookup=lookup,
        )
        return Executed(outcome, result, source, run_status=answer.get("run_status", "running"))

    def _look_up(
        self,
        tool_call_id: int,
        key: str,
        arguments: Mapping[str, Any],
        lookup: LookupFn,
        state: Callable[[str, Any], Mapping[str, Any] | None] | None,
        max_lookups: int,
    ) -> Executed | None:
        """Lookups until one decides: the recorded outcome, or None after an accepted
        ``absent`` (the caller dispatches again)."""
        failures = early = 0
        while failures < max_lookups:
            begun = self.begin_lookup(tool_call_id)
            try:
                found = lookup(key, arguments)
            except Exception as exc:  # a lookup that fails is NOT absence
                found = Found("unknown", detail=f"{type(exc).__name__}: {exc}")
            if found.outcome == "found":
                return self._record(
                    tool_call_id,
                    "succeeded",
                    found.result,
                    found.external_ref,
                    "reconciliation",
                    state,
                    begun.number,
                )
            if found.outcome == "absent":
                try:
                    answer = self.receipt(
                        tool_call_id, "absent", source="reconciliation", lookup=begun.number
                    )
                except LookupTooEarly:
                    # it looked before the original request could no longer land: look again
                    # once it cannot (bounded: the landing deadline does not move)
                    early += 1
                    if early > 3:
                        raise
                    time.sleep(begun.seconds_until_resend() + 0.05)
                    continue
                if answer.get("run_status", "running") != "running":
                    return Executed("needs_attention", run_status=answer["run_status"])
                return None
            failures += 1
            self.receipt(
                tool_call_id,
                "unknown",
                source="reconciliation",
                result=found.detail,
                lookup=begun.number,
            )
            time.sleep(min(2 ** (failures - 1) * 0.5, 10.0))
        return Executed("undecided", reason=f"{max_lookups} lookups could not tell")

    def finish(self, result: Any = None) -> dict[str, Any]:
        data = self._post(f"runs/{self.run_id}/finish/", {"status": "succeeded", "result": result})
        self.stop_heartbeat()
        return data

    def fail(self, reason: str) -> dict[str, Any]:
        data = self._post(f"runs/{self.run_id}/finish/", {"status": "failed", "reason": reason})
        self.stop_heartbeat()
        return data


# --- webhooks -----------------------------------------------------------------------------------


class WebhookVerificationError(Exception):
    pass


def verify_webhook(
    secret: str,
    headers: Mapping[str, str],
    body: bytes,
    *,
    tolerance: float = 300.0,
    now: float | None = None,
) -> dict[str, Any]:
    """Check a webhook request and return its JSON body. Refuses a bad or missing signature
    and a timestamp more than ``tolerance`` seconds from now (a replayed request).
    ``headers`` is looked up case-insensitively.

    The signature (``v2``) covers the delivery id (``Agentops-Webhook-Id``), the timestamp and
    the body: keep the ids you have handled (for longer than ``tolerance``) and ignore one seen
    before — a replay within the tolerance, or a retry of a delivery you already processed."""
    lowered = {key.lower(): value for key, value in headers.items()}
    delivery_id = lowered.get(DELIVERY_HEADER.lower(), "")
    timestamp = lowered.get(TIMESTAMP_HEADER.lower(), "")
    signature = lowered.get(SIGNATURE_HEADER.lower(), "")
    if not delivery_id.isdigit() or not timestamp.isdigit() or not signature.startswith("v2="):
        raise WebhookVerificationError("missing or malformed signature headers")
    current = time.time() if now is None else now
    if abs(current - int(timestamp)) > tolerance:
        raise WebhookVerificationError("stale timestamp: refusing a possibly replayed request")
    signed = f"{delivery_id}.{timestamp}.".encode() + body
    expected = hmac.new(secret.encode(), signed, hashlib.sha256).hexdigest()
    if not hmac.compare_digest("v2=" + expected, signature):
        raise WebhookVerificationError("signature does not match")
    return json.loads(body)

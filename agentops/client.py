"""A small typed client for the agentops API, for remote agents and scripts.

Standalone: it needs only ``httpx`` and imports nothing from Django or the rest of agentops,
so an agent process can vendor this one file. See docs/remote-agents.md for a complete agent.

    client = Client("https://agentops.example.com", token=os.environ["AGENTOPS_TOKEN"])
    with client.lease(run_id, owner="refunder-1") as run:   # heartbeats in the background
        for call in run.resume.unknown_outcomes:             # reconcile before anything new
            ...
        proposal = run.propose("refund", {"order_id": "ord_1", "amount_cents": 500})
        if proposal.decision == "approved":
            dispatch = run.dispatch(proposal.tool_call_id)
            ...                                              # call the tool with dispatch.idempotency_key
            run.receipt(proposal.tool_call_id, "succeeded", result=...)
        wait = run.wait_for_signal("customer_replied", timeout=3 * 86400)
        if wait.waiting:                                     # the lease is released: exit; the
            return                                           # run.wait_ended webhook wakes us
        run.finish({"refunded": True, "reply": wait.outcome.output})

Errors are raised as ``ApiError`` subclasses named after the API's error codes; a
``LeaseLost`` means this process must stop advancing the run at once (another process took
over, or an operator paused or terminated it).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from types import TracebackType
from typing import Any

import httpx

__all__ = [
    "ApiError",
    "Client",
    "Dispatch",
    "LeaseHeld",
    "LeaseLost",
    "Proposal",
    "RemoteRun",
    "Resume",
    "ToolCallInfo",
    "Wait",
    "WaitOutcome",
    "WebhookVerificationError",
    "verify_webhook",
]

SIGNATURE_HEADER = "Agentops-Webhook-Signature"
TIMESTAMP_HEADER = "Agentops-Webhook-Timestamp"
EVENT_HEADER = "Agentops-Webhook-Event"
DELIVERY_HEADER = "Agentops-Webhook-Id"


# --- errors ------------------------------------------------------------------------------------


class ApiError(Exception):
    """An error answer: ``code`` is the API's machine code (see docs/api.md)."""

    def __init__(
        self, status: int, code: str, detail: str, fields: Mapping[str, list[str]] | None = None
    ) -> None:
        super().__init__(f"{status} {code}: {detail}")
        self.status = status
        self.code = code
        self.detail = detail
        self.fields = dict(fields or {})


class ValidationError(ApiError):
    pass


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


class BudgetExhausted(ApiError):
    pass


class Throttled(ApiError):
    pass


_ERRORS: dict[str, type[ApiError]] = {
    "validation_error": ValidationError,
    "unknown_agent": ValidationError,
    "not_found": NotFound,
    "permission_denied": PermissionDenied,
    "not_authenticated": NotAuthenticated,
    "invalid_state": InvalidState,
    "lease_held": LeaseHeld,
    "lease_lost": LeaseLost,
    "budget_exhausted": BudgetExhausted,
    "throttled": Throttled,
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

    @property
    def last_wait(self) -> WaitOutcome | None:
        return self.waits[-1] if self.waits else None

    @property
    def next_seq(self) -> int:
        """The number the run's next step gets (pass it as ``seq`` to make a retry safe)."""
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


@dataclass(frozen=True)
class Dispatch:
    """``go``: call the tool now with ``idempotency_key`` and ``arguments`` (an approver may
    have edited them). Otherwise ``reason`` says why not (the call's status changed)."""

    go: bool
    idempotency_key: str
    arguments: dict[str, Any]
    attempt: int
    status: str
    reason: str


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
    ) -> Any:
        """One request; an error answer raises the ``ApiError`` for its code. Nothing is
        retried here: a write may have been applied when its answer was lost, and only the
        caller knows whether sending it again is safe."""
        response = self._http.request(
            method, path.lstrip("/"), json=json, params=params, headers=headers
        )
        if response.status_code >= 400:
            try:
                body = response.json()
            except ValueError:
                body = {}
            code = body.get("code", "server_error") if isinstance(body, dict) else "server_error"
            detail = body.get("detail", response.text[:500]) if isinstance(body, dict) else ""
            error = _ERRORS.get(code, ApiError)
            raise error(response.status_code, code, detail, body.get("fields"))
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

    def get_run(self, run_id: str) -> dict[str, Any]:
        return self.request("GET", f"runs/{run_id}/")

    def events(self, run_id: str, *, after_seq: int = 0) -> Iterator[dict[str, Any]]:
        """Every event after ``after_seq``, page by page."""
        while True:
            page = self.request(
                "GET", f"runs/{run_id}/events/", params={"after_seq": after_seq, "limit": 500}
            )
            yield from page["results"]
            if not page["next"]:
                return
            after_seq = page["last_seq"]

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
    """The run while this process holds its lease. Every write carries the fence."""

    def __init__(self, client: Client, data: Mapping[str, Any]) -> None:
        self.client = client
        self.run_id: str = str(data["run"])
        self.fence: int = data["fence"]
        self.lease_expires_at: str = data["lease_expires_at"]
        self.lease_ttl: float = float(data.get("lease_ttl_seconds", 30.0))
        self.resume = Resume.from_json(data["resume"])
        self.requested_action = ""
        self.lost: ApiError | None = None
        self._stop = threading.Event()
        self._beater: threading.Thread | None = None

    def _post(self, path: str, body: Mapping[str, Any] | None = None) -> Any:
        return self.client.request("POST", path, json={"fence": self.fence, **(body or {})})

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
        self, tool: str, arguments: Mapping[str, Any], *, precondition: str = ""
    ) -> Proposal:
        data = self._post(
            f"runs/{self.run_id}/tool-calls/",
            {"tool": tool, "arguments": dict(arguments), "precondition": precondition},
        )
        call = data.get("tool_call") or {}
        return Proposal(
            decision=data["decision"],
            step_seq=data["step_seq"],
            tool_call_id=call.get("id"),
            approval_id=data.get("approval"),
            error=data.get("error", ""),
        )

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
        """Mark the call ``dispatching`` *before* calling the tool (a retried request with
        the same fence gets the same answer)."""
        data = self._post(f"tool-calls/{tool_call_id}/dispatch/", {"precondition": precondition})
        return Dispatch(
            go=data["go"],
            idempotency_key=data["idempotency_key"],
            arguments=dict(data["arguments"] or {}),
            attempt=data["attempt"],
            status=data["tool_call"]["status"],
            reason=data["reason"],
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
    ) -> dict[str, Any]:
        """``succeeded``/``failed`` (the tool answered), ``unknown`` (timeout, reset, 5xx),
        or, with ``source="reconciliation"``, what a lookup by key found: ``succeeded``,
        ``failed`` or ``absent``."""
        body: dict[str, Any] = {
            "outcome": outcome,
            "source": source,
            "result": result,
            "external_ref": external_ref,
        }
        if state is not None:
            body["state"] = dict(state)
        return self._post(f"tool-calls/{tool_call_id}/receipt/", body)

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
    ``headers`` is looked up case-insensitively."""
    lowered = {key.lower(): value for key, value in headers.items()}
    timestamp = lowered.get(TIMESTAMP_HEADER.lower(), "")
    signature = lowered.get(SIGNATURE_HEADER.lower(), "")
    if not timestamp.isdigit() or not signature.startswith("v1="):
        raise WebhookVerificationError("missing or malformed signature headers")
    current = time.time() if now is None else now
    if abs(current - int(timestamp)) > tolerance:
        raise WebhookVerificationError("stale timestamp: refusing a possibly replayed request")
    expected = hmac.new(
        secret.encode(), timestamp.encode() + b"." + body, hashlib.sha256
    ).hexdigest()
    if not hmac.compare_digest("v1=" + expected, signature):
        raise WebhookVerificationError("signature does not match")
    return json.loads(body)

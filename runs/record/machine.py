"""The state machine of a run, a step and a tool call: every allowed move, in one table each.

The record checks a move at the write (``runs.record.checkpoint`` for a run's status,
``runs.record.transitions`` for a call's and a step's): a move the table does not list
raises ``ForbiddenMove`` and the whole commit rolls back. Staying in a status is always
allowed (a takeover claims a ``running`` run again; the fence moves, the status does not).

A run's reason code says why it stopped where it did. ``RUN_REASONS`` lists the codes each
status may carry ("" is no reason); ``check`` refuses a move that gives a status a reason it
cannot have. ``tests/runs/test_machine.py`` walks every move, allowed and forbidden, through
the real write.
"""

from __future__ import annotations

from runs.models import Run, Step, ToolCall

R = Run.Status
Why = Run.Reason
C = ToolCall.Status
S = Step.Status


class ForbiddenMove(Exception):
    """A write asked for a move the state machine does not allow: nothing is written."""


# a run: queued -> running (the claim) -> a wait, a park, a release or an end
RUN_MOVES: dict[str, frozenset[str]] = {
    # queued: claimed; parked by the sweeper (recovery limit) or a deploy check; paused or
    # terminated by an operator before any worker took it
    R.QUEUED: frozenset({R.RUNNING, R.NEEDS_ATTENTION, R.PAUSED, R.TERMINATED, R.FAILED}),
    R.RUNNING: frozenset(
        {
            R.QUEUED,  # released: end of a slice, an operator's retry, a lost dependency
            R.WAITING_APPROVAL,
            R.WAITING_EVENT,
            R.NEEDS_ATTENTION,
            R.PAUSED,
            R.SUCCEEDED,
            R.FAILED,
            R.TERMINATED,
        }
    ),
    # a wait ends when it is settled (queued), when its timer or timeout is due (claimed
    # directly), or by an operator
    R.WAITING_APPROVAL: frozenset(
        {R.QUEUED, R.RUNNING, R.NEEDS_ATTENTION, R.PAUSED, R.FAILED, R.TERMINATED}
    ),
    R.WAITING_EVENT: frozenset({R.QUEUED, R.RUNNING, R.NEEDS_ATTENTION, R.PAUSED, R.TERMINATED}),
    # a person resolves it (queued) or ends it
    R.NEEDS_ATTENTION: frozenset({R.QUEUED, R.PAUSED, R.FAILED, R.TERMINATED}),
    R.PAUSED: frozenset({R.QUEUED, R.TERMINATED}),
    # ended: nothing moves an ended run (a fork is a new run)
    R.SUCCEEDED: frozenset(),
    R.FAILED: frozenset(),
    R.TERMINATED: frozenset(),
}

# the reason codes each status may carry ("" is none)
RUN_REASONS: dict[str, frozenset[str]] = {
    R.NEEDS_ATTENTION: frozenset(
        {
            Why.UNKNOWN_OUTCOME,
            Why.RECOVERY_LIMIT,
            Why.BUDGET_EXHAUSTED,
            Why.INCOMPATIBLE_AGENT_VERSION,
            Why.TOOL_RETIRED,
            Why.PRECONDITION_FAILED,
            Why.MODEL_UNAVAILABLE,
        }
    ),
    R.PAUSED: frozenset({"", Why.PRINCIPAL_REVOKED}),
    R.FAILED: frozenset(
        {
            "",
            Why.AGENT_FAILED,
            Why.APPROVAL_REJECTED,
            Why.APPROVAL_EXPIRED,
            Why.RECOVERY_LIMIT,
            Why.BUDGET_EXHAUSTED,
            Why.PRECONDITION_FAILED,
            Why.TOOL_RETIRED,
            Why.MODEL_UNAVAILABLE,
        }
    ),
    # an operator, or an approval policy that ends the run when its approval is refused
    R.TERMINATED: frozenset(
        {"", Why.OPERATOR_TERMINATED, Why.APPROVAL_EXPIRED, Why.APPROVAL_REJECTED}
    ),
}

# a step: decided (pending), then completed or failed, once
STEP_MOVES: dict[str, frozenset[str]] = {
    S.PENDING: frozenset({S.COMPLETED, S.FAILED}),
    S.COMPLETED: frozenset(),
    S.FAILED: frozenset(),
}

# a tool call: proposed -> (approval) -> dispatching -> a receipt, or unknown until one
CALL_MOVES: dict[str, frozenset[str]] = {
    # a receipt adopted from the same family's earlier call settles it at once
    C.PROPOSED: frozenset(
        {
            C.AWAITING_APPROVAL,
            C.APPROVED,
            C.DISPATCHING,
            C.SUCCEEDED,
            C.FAILED,
            C.UNKNOWN,
            C.CANCELLED,
        }
    ),
    # the approval can be invalidated and asked again (a changed tool), so it may stay
    C.AWAITING_APPROVAL: frozenset({C.APPROVED, C.REJECTED, C.CANCELLED, C.PROPOSED}),
    C.APPROVED: frozenset({C.DISPATCHING, C.AWAITING_APPROVAL, C.CANCELLED, C.UNKNOWN}),
    # dispatching: the receipt, or unknown when nobody knows whether it happened; cancelled
    # only when it provably never left (a refused pre-send check on a run that ended)
    C.DISPATCHING: frozenset({C.SUCCEEDED, C.FAILED, C.UNKNOWN, C.CANCELLED}),
    # unknown: reconciled (a receipt), dispatched again after a lookup proved it absent, or
    # given up by a person
    C.UNKNOWN: frozenset({C.SUCCEEDED, C.FAILED, C.DISPATCHING, C.CANCELLED}),
    C.REJECTED: frozenset(),
    C.SUCCEEDED: frozenset(),
    C.FAILED: frozenset(),
    C.CANCELLED: frozenset(),
}

TABLES: dict[str, dict[str, frozenset[str]]] = {
    "run": RUN_MOVES,
    "step": STEP_MOVES,
    "call": CALL_MOVES,
}


def allowed(entity: str, before: str, after: str) -> bool:
    return before == after or after in TABLES[entity][before]


def check(entity: str, before: str, after: str, *, reason: str | None = None) -> None:
    """Raise ``ForbiddenMove`` unless ``entity`` may move from ``before`` to ``after``
    (and, for a run, carry ``reason`` there; None: the write leaves the reason as it is)."""
    if not allowed(entity, before, after):
        raise ForbiddenMove(f"a {entity} cannot move from {before} to {after}")
    if entity == "run" and reason is not None:
        reasons = RUN_REASONS.get(after, frozenset({""}))
        if reason not in reasons:
            raise ForbiddenMove(f"a run cannot be {after} with the reason {reason or 'none'!r}")

"""Every type of event a run's record holds, in one catalogue (DESIGN §2 and the additions
since). ``Checkpoint.event`` refuses any other type; the admin's filter, the console's event
search and docs/audit.md's list are made from this enum (``manage.py event_types``), and
``tests/test_catalogues.py`` checks that the code writes no type it does not list."""

from __future__ import annotations

from django.db import models


class EventType(models.TextChoices):
    # a run's life
    RUN_CREATED = "run.created", "A run was started (by a person, an API token or a schedule)"
    RUN_FORKED = "run.forked", "A run was started as a fork of another from one of its steps"
    RUN_PROMOTED = "run.promoted", "A finished dry run was started for real as a new run"
    RUN_CLAIMED = "run.claimed", "A worker or an agent process took the run's lease"
    RUN_RELEASED = "run.released", "The lease holder let the run go (end of a slice, a retry)"
    RUN_HANDED_OFF = "run.handed_off", "A worker that was stopping handed the run to another"
    RUN_LEASE_LOST = "run.lease_lost", "A worker found its lease taken over and stopped"
    RUN_LEASE_EXPIRED = "run.lease_expired", "A remote agent's lease ran out"
    RUN_MIGRATED = "run.migrated", "The run moved to the agent's deployed version"
    RUN_MODEL_CHANGED = "run.model_changed", "The run's model changed (its pinned one withdrawn)"
    RUN_MODEL_PINNED = "run.model_pinned", "The run's first model request pinned its model"
    RUN_WAITING = "run.waiting", "The run waits: for an approval, a signal, a timer or an answer"
    RUN_WAIT_ENDED = "run.wait_ended", "A wait ended (its signal, answer or timer came)"
    RUN_WAIT_TIMED_OUT = "run.wait_timed_out", "A wait ended by its timeout"
    RUN_SIGNALLED = "run.signalled", "A signal was delivered to the run"
    RUN_NEEDS_ATTENTION = "run.needs_attention", "The engine cannot go on alone: a person must act"
    RUN_PAUSE_REQUESTED = "run.pause_requested", "An operator asked a running run to pause"
    RUN_PAUSED = "run.paused", "The run was paused (by an operator or the system)"
    RUN_RESUMED = "run.resumed", "An operator resumed the run"
    RUN_RECOVERY_RETRIED = "run.recovery_retried", "An operator let a run past its recovery limit"
    RUN_BUDGET_TOPPED_UP = "run.budget_topped_up", "An operator raised the run's budget"
    RUN_TERMINATE_REQUESTED = "run.terminate_requested", "An operator asked to terminate the run"
    RUN_TERMINATED = "run.terminated", "The run was ended by an operator or its approval policy"
    RUN_SUCCEEDED = "run.succeeded", "The run's agent finished it"
    RUN_FAILED = "run.failed", "The run failed"
    RUN_PRUNED = "run.pruned", "The run's history was pruned (its chain head is kept)"
    RUN_STATE_PATCHED = "run.state_patched", "A remote agent patched its run's state (JSON Patch)"
    # steps
    STEP_DECIDED = "step.decided", "The agent decided a step (a tool call, a wait, the end)"
    STEP_FAILED = "step.failed", "A step failed"
    # tool calls
    TOOL_DISPATCHING = "tool.dispatching", "A tool call is about to be sent, with its deadlines"
    TOOL_SUCCEEDED = "tool.succeeded", "A tool call's receipt: it succeeded"
    TOOL_FAILED = "tool.failed", "A tool call's receipt: it failed"
    TOOL_UNKNOWN = "tool.unknown", "Nobody knows whether a tool call took effect"
    TOOL_LOOKUP_BEGUN = "tool.lookup_begun", "A remote agent began looking up an unknown call"
    TOOL_RECONCILE_ATTEMPTED = "tool.reconcile_attempted", "An unknown call was looked up"
    TOOL_RESOLVED = "tool.resolved", "A person settled an unknown outcome"
    TOOL_CANCELLED = "tool.cancelled", "A call that never left was cancelled"
    TOOL_VERSION_ACCEPTED = (
        "tool.version_accepted",
        "A call of a compatible earlier tool version went on",
    )
    TOOL_VERSION_CHANGED = "tool.version_changed", "A call moved to its tool's new version"
    TOOL_CAPACITY_GRANTED = "tool.capacity_granted", "A call got a slot under its tool's limit"
    # spend caps (runs.spend)
    SPEND_CAP_REACHED = "spend.cap_reached", "A spend cap's scope was used up: the run stopped"
    SPEND_CUT_OFF = "spend.cut_off", "A model request a crash cut off was charged at its maximum"
    SPEND_SETTLED = "spend.settled", "An operator settled a cut-off request with its real usage"
    # approvals
    APPROVAL_REQUESTED = "approval.requested", "A tool call's approval was asked"
    APPROVAL_DECIDED = "approval.decided", "An approver decided (approved or rejected)"
    APPROVAL_COMMENTED = "approval.commented", "An approver commented"
    APPROVAL_CONSUMED = "approval.consumed", "An approval was used by its call's dispatch"
    APPROVAL_EXPIRED = "approval.expired", "An approval expired undecided"
    APPROVAL_CANCELLED = (
        "approval.cancelled",
        "An approval was cancelled (its call changed or ended)",
    )
    APPROVAL_REMINDER_DUE = "approval.reminder_due", "An approval waited long: approvers reminded"
    APPROVAL_EMAIL_SENT = "approval.email_sent", "An approval email reached the mail server"
    APPROVAL_EMAIL_FAILED = "approval.email_failed", "An approval email could not be sent"
    APPROVAL_LINK_USED = "approval.link_used", "An emailed approval link was used"
    # questions (a wait for a person's answer)
    QUESTION_ASKED = "question.asked", "The agent asked a person a question"
    QUESTION_ANSWERED = "question.answered", "A person answered the question"
    QUESTION_EXPIRED = "question.expired", "The question expired unanswered"
    QUESTION_CANCELLED = "question.cancelled", "The question was withdrawn (its run ended)"
    QUESTION_EMAIL_SENT = "question.email_sent", "A question email reached the mail server"
    QUESTION_EMAIL_FAILED = "question.email_failed", "A question email could not be sent"
    QUESTION_LINK_USED = "question.link_used", "An emailed question link was used"
    # the agent, the model
    AGENT_POSTPONED = "agent.postponed", "The agent's model was unavailable: the decision waits"
    # the MCP gateway (agentops/mcp): a client's tools/call recorded in its run
    MCP_CALL_RECEIVED = "mcp.call_received", "An MCP client's tools/call arrived"


KNOWN: frozenset[str] = frozenset(EventType.values)


def markdown_table() -> str:
    """docs/audit.md's list of event types (``manage.py event_types``)."""
    lines = ["| Event type | What happened |", "| --- | --- |"]
    lines += [f"| `{value}` | {label} |" for value, label in EventType.choices]
    return "\n".join(lines)

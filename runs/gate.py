"""The approval gate: how the engine asks "may this call be dispatched now?".

``runs`` never imports ``approvals``. The approvals app registers an implementation when it
loads (``ApprovalsConfig.ready``); without one, a call whose policy requires approval is
refused (the engine fails the step) rather than dispatched unapproved.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from runs.record import configcache

if TYPE_CHECKING:
    from runs.models import Run, ToolCall
    from runs.record.checkpoint import Checkpoint
    from runs.registry import Tool


class GateRefused(Exception):
    """No valid approval for this exact call: it must not be dispatched. ``reason`` is why
    its approval is withdrawn before a new one is asked (``superseded``, ``policy_changed``)."""

    def __init__(self, message: str, *, reason: str = "superseded") -> None:
        super().__init__(message)
        self.reason = reason


@dataclass(frozen=True)
class Verdict:
    """What the approval policy says of one call (docs/approvals.md, "Policies"): ``allow``,
    ``deny`` (the step fails with ``reason``, which the agent sees) or ``require_approval``.
    ``policy_version``: the data policy version that decided (None: the tool's code policy).
    ``requirement``: the approval asked for, the gate's own business."""

    outcome: str
    reason: str = ""
    policy_version: Any = None
    requirement: Any = None

    ALLOW = "allow"
    DENY = "deny"
    REQUIRE_APPROVAL = "require_approval"

    @property
    def needs_approval(self) -> bool:
        return self.outcome == self.REQUIRE_APPROVAL

    @property
    def denied(self) -> bool:
        return self.outcome == self.DENY


def code_verdict(tool: Tool, arguments: Any) -> Verdict:
    """The tool's code policy (never / always / a predicate): the default."""
    needed = tool.approval.requires_approval(arguments)
    return Verdict(Verdict.REQUIRE_APPROVAL if needed else Verdict.ALLOW)


def policy_facts(run: Run) -> dict[str, Any]:
    """What a policy may read of a call besides its arguments, as of now: the principal and
    its groups, the agent, the run's spend so far and the time. Recorded on the call
    (``ToolCall.policy_input``) when it is decided, so a policy is re-evaluated — at the
    dispatch, or in a simulation — on what was true then. The principal's name and groups
    come from what this process read of them since they last changed (``principal_facts``):
    no query on a step's path."""
    from django.utils import timezone

    username, groups = principal_facts(run.principal_id)
    return {
        "principal": username,
        "groups": groups,
        "agent": run.agent_name,
        "spend": str(run.cost_used),
        # the application's clock, not the database's: a time of day for rules, never a
        # deadline (and no query on the decision's path)
        "at": timezone.now().isoformat(),
    }


def _forget_principals(generation: str | None) -> dict[Any, tuple[str, list[str]]]:
    return {}  # each principal is read at its first decision (``principal_facts``)


# principal id -> (username, sorted group names), as read since a user's name, a membership
# or a group's name last changed anywhere (a trigger moves the generation: migration 0030)
_principals = configcache.register(
    "principals",
    generation_sql=configcache.token_generation_sql("principals"),
    read=_forget_principals,
)


def principal_facts(principal_id: Any) -> tuple[str, list[str]]:
    """A principal's username and group names ("" and [] for none), as of this run's claim:
    a change of groups made anywhere applies from the next claim on."""
    if principal_id is None:
        return "", []
    known = _principals.get()
    facts = known.get(principal_id)
    if facts is None:
        from django.contrib.auth import get_user_model
        from django.contrib.auth.models import Group

        user_model = get_user_model()
        username = (
            user_model.objects.filter(pk=principal_id)
            .values_list(user_model.USERNAME_FIELD, flat=True)
            .first()
        ) or ""
        groups = sorted(Group.objects.filter(user__pk=principal_id).values_list("name", flat=True))
        if len(known) > 10_000:
            known.clear()  # bounded: a process serving many principals reads them again
        facts = known[principal_id] = (username, groups)
    return facts[0], list(facts[1])


@dataclass(frozen=True)
class GateView:
    """What ``runs`` may know of one approval of a call, without reading approvals' tables:
    its id and its state — ``pending``, ``approved`` (not yet used), ``consumed`` (used by
    a dispatch), ``rejected``, ``expired`` or ``cancelled`` (invalidated: the run ended,
    the call or its tool changed)."""

    id: Any
    state: str

    @property
    def live(self) -> bool:
        """Still deciding, or decided yes and not used: the call's current approval."""
        return self.state in ("pending", "approved")


class ApprovalGate(Protocol):
    def assess(self, *, run: Run, tool: Tool, arguments: Any, facts: dict[str, Any]) -> Verdict:
        """The current policy's verdict on a call with ``arguments`` decided with ``facts``
        (``policy_facts``): the data policy's current version, else the tool's code policy."""

    def approvals_of(self, call_ids: Iterable[Any]) -> dict[Any, list[GateView]]:
        """Each call's approvals, oldest first (one query whatever the number of calls);
        a call with none is absent."""

    def request(self, *, cp: Checkpoint, run: Run, call: ToolCall, tool: Tool) -> None:
        """Inside the ``approval_requested`` transaction: create the pending approval and
        append ``approval.requested`` through ``cp``."""

    def consume(
        self, *, cp: Checkpoint, call: ToolCall, tool: Tool, verdict: Verdict | None = None
    ) -> None:
        """Inside the ``dispatching`` transaction: mark the call's approval consumed, once.
        Raises ``GateRefused`` when there is no unconsumed approval bound to this call's
        tool, tool version and argument digest, or when the approval no longer satisfies
        ``verdict`` (the current policy's, re-evaluated in this transaction)."""

    def cancel(self, *, cp: Checkpoint, call: ToolCall, reason: str) -> None:
        """The call will never be dispatched (run ended, call cancelled): cancel its
        pending approvals."""


class _NoGate:
    installed = False

    def assess(self, *, run, tool, arguments, facts) -> Verdict:
        return code_verdict(tool, arguments)

    def approvals_of(self, call_ids) -> dict:
        return {}

    def request(self, *, cp, run, call, tool) -> None:
        raise GateRefused("no approval gate is installed; the call needs approval")

    def consume(self, *, cp, call, tool, verdict=None) -> None:
        raise GateRefused("no approval gate is installed; the call needs approval")

    def cancel(self, *, cp, call, reason) -> None:
        return None


_gate: ApprovalGate = _NoGate()


def register_gate(gate: ApprovalGate) -> None:
    global _gate
    _gate = gate


def get_gate() -> ApprovalGate:
    return _gate


def gate_installed() -> bool:
    return getattr(_gate, "installed", True)


def recorded_facts(run: Run, call: ToolCall) -> dict[str, Any]:
    """The facts recorded when ``call`` was decided; for a call decided before they were
    recorded, the run's as of now."""
    return call.policy_input or policy_facts(run)


def assess(*, run: Run, tool: Tool, arguments: Any, facts: dict[str, Any]) -> Verdict:
    return _gate.assess(run=run, tool=tool, arguments=arguments, facts=facts)

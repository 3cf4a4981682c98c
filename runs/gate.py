"""The approval gate: how the engine asks "may this call be dispatched now?".

``runs`` never imports ``approvals``. The approvals app registers an implementation when it
loads (``ApprovalsConfig.ready``); without one, a call whose policy requires approval is
refused (the engine fails the step) rather than dispatched unapproved.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from runs.models import Run, ToolCall
    from runs.record.checkpoint import Checkpoint
    from runs.registry import Tool


class GateRefused(Exception):
    """No valid approval for this exact call: it must not be dispatched."""


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
    def approvals_of(self, call_ids: Iterable[Any]) -> dict[Any, list[GateView]]:
        """Each call's approvals, oldest first (one query whatever the number of calls);
        a call with none is absent."""

    def request(self, *, cp: Checkpoint, run: Run, call: ToolCall, tool: Tool) -> None:
        """Inside the ``approval_requested`` transaction: create the pending approval and
        append ``approval.requested`` through ``cp``."""

    def consume(self, *, cp: Checkpoint, call: ToolCall, tool: Tool) -> None:
        """Inside the ``dispatching`` transaction: mark the call's approval consumed, once.
        Raises ``GateRefused`` when there is no unconsumed approval bound to this call's
        tool, tool version and argument digest."""

    def cancel(self, *, cp: Checkpoint, call: ToolCall, reason: str) -> None:
        """The call will never be dispatched (run ended, call cancelled): cancel its
        pending approvals."""


class _NoGate:
    installed = False

    def approvals_of(self, call_ids) -> dict:
        return {}

    def request(self, *, cp, run, call, tool) -> None:
        raise GateRefused("no approval gate is installed; the call needs approval")

    def consume(self, *, cp, call, tool) -> None:
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

"""The approval gate: how the engine asks "may this call be dispatched now?".

``runs`` never imports ``approvals``. The approvals app registers an implementation when it
loads (``ApprovalsConfig.ready``); without one, a call whose policy requires approval is
refused (the engine fails the step) rather than dispatched unapproved.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from runs.models import Run, ToolCall
    from runs.record.checkpoint import Checkpoint
    from runs.registry import Tool


class GateRefused(Exception):
    """No valid approval for this exact call: it must not be dispatched."""


class ApprovalGate(Protocol):
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

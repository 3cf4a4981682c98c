"""The durable run engine (DESIGN §3–§5).

One call to ``advance(run_id, worker=...)`` claims the run's lease and drives it for a slice
of steps. Everything it does is re-derived from the record: the open step, its tool call's
status, the receipt. Every write goes through ``checkpoint(fence=...)``; a write that matches
no row (the fence moved on) raises ``LeaseLost`` and this process stops at once.

Never is a transaction or row lock held across a tool call, a lookup or an agent decision.

The package, by responsibility, each module importing only those before it: ``lease`` (the
``Lease`` an incarnation holds and its fenced checkpoint; releasing, parking, pausing,
finishing), ``claim`` (the compare-and-set that takes the lease), ``serving`` (handing a
run this worker's code cannot serve to one that can: rolling deploys), ``toolcalls`` (dispatch,
the call, the receipt, unknown outcomes and their reconciliation), ``deciding`` (the
``decided`` checkpoint for each kind of action, and waits), ``continuing`` (an open step
found at claim) and ``loop`` (``advance``: the slice and the checks before it). Everything
other code uses is imported from here, including the transitions ``runs.remote`` calls with
``execute=False``.
"""

from __future__ import annotations

from runs.engine.claim import claim
from runs.engine.continuing import _settle_from_record, _tool_accepts, _tool_changed
from runs.engine.deciding import _continue_wait, _decide_call, _decide_wait, _family_call
from runs.engine.lease import (
    Lease,
    Outcome,
    _finish,
    _park_needs_attention,
    _pause_principal_revoked,
    _principal_refusal,
    _release,
)
from runs.engine.loop import (
    _advance_once,
    _budget_exhausted,
    _drive,
    _honour_request,
    _migrate_agent_version,
    advance,
    set_stop_check,
)
from runs.engine.toolcalls import (
    _can_land_until,
    _complete_step,
    _dispatch,
    _fail_step,
    _mark_unknown,
    _record_receipt,
    presend_row,
)
from runs.record.checkpoint import lease_expiry

__all__ = [
    "Lease",
    "Outcome",
    "advance",
    "claim",
    "lease_expiry",
    "presend_row",
    "set_stop_check",
    # the engine's own steps, for runs.remote (which calls them with execute=False) and tests
    "_advance_once",
    "_budget_exhausted",
    "_can_land_until",
    "_complete_step",
    "_continue_wait",
    "_decide_call",
    "_decide_wait",
    "_dispatch",
    "_drive",
    "_fail_step",
    "_family_call",
    "_finish",
    "_honour_request",
    "_mark_unknown",
    "_migrate_agent_version",
    "_park_needs_attention",
    "_pause_principal_revoked",
    "_principal_refusal",
    "_record_receipt",
    "_release",
    "_settle_from_record",
    "_tool_accepts",
    "_tool_changed",
]

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
from runs.engine.continuing import open_call, settle_from_record, tool_accepts, tool_changed
from runs.engine.deciding import continue_wait, decide_call, decide_wait, family_call
from runs.engine.lease import (
    Lease,
    Outcome,
    finish,
    park_needs_attention,
    pause_principal_revoked,
    principal_refusal,
    release,
)
from runs.engine.loop import (
    advance,
    advance_once,
    budget_exhausted,
    drive,
    honour_request,
    migrate_agent_version,
    resume_checks,
    set_stop_check,
)
from runs.engine.toolcalls import (
    absent_proves_never_landed,
    can_land_until,
    complete_step,
    dispatch,
    fail_step,
    mark_unknown,
    park_resend_for_person,
    park_unknown_outcome,
    presend_row,
    record_receipt,
    resend_needs_person,
    simulates,
    unknown_needs_person,
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
    "advance_once",
    "budget_exhausted",
    "can_land_until",
    "complete_step",
    "continue_wait",
    "decide_call",
    "absent_proves_never_landed",
    "park_resend_for_person",
    "park_unknown_outcome",
    "resend_needs_person",
    "unknown_needs_person",
    "decide_wait",
    "dispatch",
    "drive",
    "fail_step",
    "family_call",
    "finish",
    "honour_request",
    "mark_unknown",
    "migrate_agent_version",
    "open_call",
    "resume_checks",
    "park_needs_attention",
    "pause_principal_revoked",
    "principal_refusal",
    "record_receipt",
    "release",
    "settle_from_record",
    "simulates",
    "tool_accepts",
    "tool_changed",
]

"""Remote agents (issue 6): agent processes outside agentops that drive their runs over the
API with the same state machine as hosted agents.

A remote agent is declared by a manifest (``AgentManifest``, ``PUT /api/v1/agents/{name}/``)
instead of code. The registry resolves its name to a ``RemoteAgent`` and its tools to
``Tool`` objects named ``<agent>/<tool>`` (so two remote agents' tools never collide with
each other or with hosted tools), so run creation, approvals, argument edits and operator
resolutions work on remote runs unchanged.

Whoever holds a remote run's lease advances it: the lease is claimed with the engine's own
compare-and-set (``engine.claim(remote=True)``), and every write afterwards goes through a
``RemoteLease`` checkpoint filtered on the fence the claim returned; a stale fence, an
expired lease or a run no longer ``running`` raises ``LeaseLost`` and nothing is written. The
transitions themselves are the engine's (``decide_call``, ``dispatch``, ``mark_unknown``,
``finish``, ...), called with ``execute=False``: the agent process makes the tool call.

Workers never claim remote runs (``runs.record.common.kind_filter``); when a remote lease expires the
sweeper hook ``remote_leases_expire`` puts the run back to ``queued`` ("waiting for an agent
process") with a ``run.lease_expired`` event (and webhook). The next process to claim the
lease gets a resume packet in which a call left ``dispatching`` is ``unknown``.

Durable waits (``remote_wait_begin``) park the run through the engine's ``decide_wait``.
Since no worker claims the run to end its wait, whatever ends it does, in its own commit
(``remote_wait_end``: a signal or an answer from ``runs.waits``, the timer or the timeout
from the sweep hook ``remote_waits_end_due``), and the run is queued for an agent process
with the ``run.wait_ended`` webhook.

The package, by responsibility: ``manifest`` (validation, registration, the registry's view),
``lease`` (claim, heartbeat, release, expiry, and ``_held``, which every write goes through),
``resume`` (the packet a claim returns), ``steps`` (decisions, finish), ``toolcalls``
(propose, dispatch, the pre-send check, lookups, receipt and reconciliation), ``waits`` and
``history`` (the state patched, the non-authoritative conversation history). Everything other code uses is
imported from here.
"""

from __future__ import annotations

from runs.registry import registry
from runs.remote.history import (
    PATCH_MAX_OPS,
    HistoryConflict,
    HistoryFull,
    InvalidPatch,
    MessagesAppended,
    MessageTooLarge,
    PatchNotApplicable,
    PatchTestFailed,
    StatePatched,
    StateVersionMismatch,
    remote_messages_append,
    remote_messages_read,
    remote_state_patch,
)
from runs.remote.lease import (
    WAITING_FOR_PROCESS,
    LeaseGrant,
    LeaseHeld,
    LeaseNotYours,
    RemoteLease,
    is_lease_holder,
    remote_lease_acquire,
    remote_lease_heartbeat,
    remote_lease_release,
    remote_leases_expire,
)
from runs.remote.manifest import (
    AGENT_NAME,
    AGENT_NAME_PATTERN,
    AGENT_NAME_RULE,
    MANIFEST_NAME_MAX,
    PREDICATE_OPS,
    SEP,
    TOOL_KEYS,
    TOOL_NAME_MAX,
    VERSION,
    VERSION_PATTERN,
    ManifestInvalid,
    RemoteAgent,
    _resolve_agent,
    _resolve_tool,
    agent_manifest_put,
    is_remote,
    manifest_tool,
    manifest_validate,
    short_tool_name,
)
from runs.remote.resume import resume_packet, wait_outcomes
from runs.remote.steps import DECISION, StepRecorded, remote_run_finish, remote_step_record
from runs.remote.toolcalls import (
    CLIENT_CALL_ID_MAX,
    CLIENT_CALL_ID_PATTERN,
    RECEIPT_OUTCOMES,
    ClientCallIdConflict,
    Dispatch,
    DispatchTooEarly,
    LookupBegun,
    LookupRequired,
    LookupSuperseded,
    LookupTooEarly,
    Proposal,
    ReconcileRequired,
    SendClearance,
    SendDeadlinePassed,
    remote_toolcall_dispatch,
    remote_toolcall_lookup_begin,
    remote_toolcall_propose,
    remote_toolcall_receipt,
    remote_toolcall_send_check,
)
from runs.remote.waits import (
    WAIT_KINDS,
    WaitBegun,
    remote_wait_begin,
    remote_wait_end,
    remote_waits_end_due,
)

__all__ = [
    "AGENT_NAME",
    "CLIENT_CALL_ID_MAX",
    "CLIENT_CALL_ID_PATTERN",
    "AGENT_NAME_PATTERN",
    "AGENT_NAME_RULE",
    "DECISION",
    "MANIFEST_NAME_MAX",
    "PATCH_MAX_OPS",
    "PREDICATE_OPS",
    "RECEIPT_OUTCOMES",
    "SEP",
    "TOOL_KEYS",
    "TOOL_NAME_MAX",
    "VERSION",
    "VERSION_PATTERN",
    "WAITING_FOR_PROCESS",
    "WAIT_KINDS",
    "Dispatch",
    "ClientCallIdConflict",
    "DispatchTooEarly",
    "HistoryConflict",
    "HistoryFull",
    "InvalidPatch",
    "LeaseGrant",
    "LeaseHeld",
    "LeaseNotYours",
    "LookupBegun",
    "LookupRequired",
    "LookupSuperseded",
    "LookupTooEarly",
    "ManifestInvalid",
    "MessageTooLarge",
    "MessagesAppended",
    "PatchNotApplicable",
    "PatchTestFailed",
    "Proposal",
    "RemoteAgent",
    "ReconcileRequired",
    "RemoteLease",
    "SendClearance",
    "SendDeadlinePassed",
    "StatePatched",
    "StateVersionMismatch",
    "StepRecorded",
    "WaitBegun",
    "agent_manifest_put",
    "install",
    "is_lease_holder",
    "is_remote",
    "manifest_tool",
    "manifest_validate",
    "remote_lease_acquire",
    "remote_lease_heartbeat",
    "remote_lease_release",
    "remote_leases_expire",
    "remote_messages_append",
    "remote_messages_read",
    "remote_run_finish",
    "remote_state_patch",
    "remote_step_record",
    "remote_toolcall_dispatch",
    "remote_toolcall_lookup_begin",
    "remote_toolcall_propose",
    "remote_toolcall_receipt",
    "remote_toolcall_send_check",
    "remote_wait_begin",
    "remote_wait_end",
    "remote_waits_end_due",
    "resume_packet",
    "short_tool_name",
    "wait_outcomes",
]


def install() -> None:
    """Called from ``RunsConfig.ready``."""
    from runs.sweeper import register_sweep_hook

    registry.set_remote_resolvers(agent=_resolve_agent, tool=_resolve_tool)
    register_sweep_hook(remote_leases_expire)
    register_sweep_hook(remote_waits_end_due)

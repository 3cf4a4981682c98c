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
transitions themselves are the engine's (``_decide_call``, ``_dispatch``, ``_mark_unknown``,
``_finish``, ...), called with ``execute=False``: the agent process makes the tool call.

Workers never claim remote runs (``engine._kind_filter``); when a remote lease expires the
sweeper hook ``remote_leases_expire`` puts the run back to ``queued`` ("waiting for an agent
process") with a ``run.lease_expired`` event (and webhook). The next process to claim the
lease gets a resume packet in which a call left ``dispatching`` is ``unknown``.

Durable waits (``remote_wait_begin``) park the run through the engine's ``_decide_wait``.
Since no worker claims the run to end its wait, whatever ends it does, in its own commit
(``remote_wait_end``: a signal or an answer from ``runs.waits``, the timer or the timeout
from the sweep hook ``remote_waits_end_due``), and the run is queued for an agent process
with the ``run.wait_ended`` webhook.
"""

from __future__ import annotations

import contextvars
import operator
import re
from collections.abc import Callable, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime
from typing import Any, cast

import jsonschema
from django.conf import settings
from django.contrib.auth.models import Group
from django.db import transaction
from django.db.models import F
from django.db.models.functions import Now
from django.utils import timezone

from runs import engine, waits
from runs.actors import Actor, PermissionDenied
from runs.dbtime import db_now
from runs.events import Checkpoint, LeaseLost, RunNotFound, checkpoint
from runs.models import AgentManifest, Question, Run, Signal, Step, ToolCall, ToolReceipt
from runs.registry import (
    Agent,
    ApprovalPolicy,
    AskQuestion,
    CallTool,
    Effect,
    OnExpiry,
    Reconciliation,
    Sleep,
    Tool,
    ToolContext,
    ToolResult,
    UnknownAgent,
    UnknownTool,
    WaitForSignal,
    digest,
    registry,
)
from runs.services import BudgetExhausted, InvalidInput, InvalidState

SEP = "/"
DECISION = Step.Kind.DECISION  # the Step kind of a remote agent's own checkpointed decision
MANIFEST_NAME_MAX = 100
# remote agents' names: safe in URLs, logs and tool names (``<agent>/<tool>``)
AGENT_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,99}$"
AGENT_NAME = re.compile(AGENT_NAME_PATTERN[1:-1])
VERSION_PATTERN = r"^[^\x00-\x1f\x7f]{1,50}$"
VERSION = re.compile(VERSION_PATTERN[1:-1])
AGENT_NAME_RULE = "1 to 100 letters, digits, '_', '.' or '-', starting with a letter or digit"
WAITING_FOR_PROCESS = "waiting for an agent process"
TOOL_NAME_MAX = 60


class LeaseHeld(InvalidState):
    code = "lease_held"


class ManifestInvalid(InvalidInput):
    def __init__(self, fields: dict[str, list[str]]) -> None:
        super().__init__("The manifest is not valid; see fields.")
        self.fields = fields


# --- the manifest -----------------------------------------------------------------------------

PREDICATE_OPS: dict[str, Callable[[Any, Any], bool]] = {
    "eq": operator.eq,
    "ne": operator.ne,
    "gt": operator.gt,
    "gte": operator.ge,
    "lt": operator.lt,
    "lte": operator.le,
    "in": lambda value, options: value in options,
}


def _predicate(spec: Mapping[str, Any]) -> Callable[[Mapping[str, Any]], bool]:
    name, op, value = spec["argument"], spec["op"], spec["value"]
    compare = PREDICATE_OPS[op]

    def when(arguments: Mapping[str, Any]) -> bool:
        if name not in arguments:
            return False
        try:
            return bool(compare(arguments[name], value))
        except TypeError:
            # an argument of a type the rule cannot compare: ask a person rather than guess
            return True

    when.__doc__ = f"{name} {op} {value!r}"
    return when


def _policy(spec: Mapping[str, Any]) -> ApprovalPolicy:
    when = spec.get("when", "never")
    return ApprovalPolicy(
        when=when if isinstance(when, str) else _predicate(when),
        group=spec.get("group", "approver"),
        required=spec.get("required", 1),
        ttl_seconds=spec.get("ttl_seconds", 24 * 3600),
        on_expiry=OnExpiry(spec.get("on_expiry", "reject")),
    )


# The fingerprint an agent process reports at propose and dispatch time (``precondition``):
# a manifest tool with ``precondition: true`` reads it through the Tool's ``precondition``
# hook, so the engine's own re-check (``_dispatch``) compares them.
_reported_fingerprint: contextvars.ContextVar[str] = contextvars.ContextVar(
    "reported_fingerprint", default=""
)


def _remote_only_call(arguments: Mapping[str, Any], ctx: ToolContext) -> ToolResult:
    raise RuntimeError("a remote agent's tool is called by the agent process, not by agentops")


def _remote_only_reconcile(key: str, arguments: Mapping[str, Any]) -> Reconciliation:
    raise RuntimeError("a remote agent's tool is reconciled by the agent process")


def manifest_tool(agent_name: str, spec: Mapping[str, Any]) -> Tool:
    effect = Effect(spec["effect"])
    return Tool(
        name=f"{agent_name}{SEP}{spec['name']}",
        effect=effect,
        call=_remote_only_call,
        schema=spec.get("argument_schema") or {"type": "object"},
        description=spec.get("description", ""),
        sensitive_fields=tuple(spec.get("sensitive_fields", ())),
        approval=_policy(spec.get("approval") or {}),
        allowed_groups=tuple(spec.get("allowed_groups", ())),
        timeout=float(spec.get("timeout", 10.0)),
        reconcile=_remote_only_reconcile if effect == Effect.RECONCILABLE else None,
        precondition=(lambda _arguments: _reported_fingerprint.get())
        if spec.get("precondition")
        else None,
        version=str(spec.get("version", "")),
    )


def _identity(state: dict[str, Any]) -> dict[str, Any]:
    return state


class RemoteAgent(Agent):
    """A manifest seen as an agent. ``decide`` is never called: the process decides."""

    kind = "remote"

    def __init__(self, manifest: AgentManifest) -> None:
        self.name = manifest.name
        self.version = manifest.version
        self.description = manifest.description if hasattr(manifest, "description") else ""
        self.input_schema = manifest.input_schema or {"type": "object"}
        self.tool_specs = {spec["name"]: spec for spec in manifest.tools}
        self.tools = tuple(f"{manifest.name}{SEP}{name}" for name in self.tool_specs)
        # The remote process migrates its own state; the hops only say which versions may
        # take over a run (the resume packet lists them, so the process knows to migrate).
        self.migrations = tuple(
            (source, hop["to"], _identity) for source, hop in (manifest.migrations or {}).items()
        )
        self.migration_notes = {
            source: hop.get("description", "")
            for source, hop in (manifest.migrations or {}).items()
        }

    def decide(self, ctx):  # pragma: no cover - remote agents decide in their own process
        raise RuntimeError("a remote agent decides in its own process")


def _resolve_agent(name: str) -> Agent | None:
    manifest = AgentManifest.objects.filter(name=name).first()
    return RemoteAgent(manifest) if manifest is not None else None


def _resolve_tool(qualified: str) -> Tool | None:
    agent_name, sep, tool_name = qualified.rpartition(SEP)
    if not sep:
        return None
    manifest = AgentManifest.objects.filter(name=agent_name).only("tools").first()
    if manifest is None:
        return None
    for spec in manifest.tools:
        if spec.get("name") == tool_name:
            return manifest_tool(agent_name, spec)
    return None


def install() -> None:
    """Called from ``RunsConfig.ready``."""
    from runs.sweeper import register_sweep_hook

    registry.set_remote_resolvers(agent=_resolve_agent, tool=_resolve_tool)
    register_sweep_hook(remote_leases_expire)
    register_sweep_hook(remote_waits_end_due)


def is_remote(agent_name: str) -> bool:
    return AgentManifest.objects.filter(name=agent_name).exists()


def short_tool_name(run_agent: str, tool_name: str) -> str:
    prefix = f"{run_agent}{SEP}"
    return tool_name[len(prefix) :] if tool_name.startswith(prefix) else tool_name


def _schema_errors(schema: Any) -> list[str]:
    if not isinstance(schema, dict):
        return ["must be a JSON object (a JSON Schema)"]
    try:
        jsonschema.Draft202012Validator.check_schema(schema)
    except jsonschema.SchemaError as exc:
        return [f"not a valid JSON Schema: {exc.message}"]
    return []


def _policy_errors(spec: Any) -> list[str]:
    if spec is None:
        return []
    if not isinstance(spec, dict):
        return ["must be an object"]
    errors = []
    unknown = set(spec) - {"when", "group", "required", "ttl_seconds", "on_expiry"}
    if unknown:
        errors.append(f"unknown keys: {', '.join(sorted(unknown))}")
    when = spec.get("when", "never")
    if isinstance(when, dict):
        if set(when) != {"argument", "op", "value"}:
            errors.append("when: a rule is {argument, op, value}")
        elif not isinstance(when["argument"], str) or when["op"] not in PREDICATE_OPS:
            errors.append(f"when: op must be one of {', '.join(PREDICATE_OPS)}")
        elif when["op"] == "in" and not isinstance(when["value"], list):
            errors.append("when: op 'in' needs a list value")
    elif when not in ("never", "always"):
        errors.append("when: 'never', 'always' or a rule {argument, op, value}")
    group = spec.get("group", "approver")
    if not isinstance(group, str) or not Group.objects.filter(name=group).exists():
        errors.append(f"group: no group named {group!r} (nobody could approve)")
    required = spec.get("required", 1)
    if not isinstance(required, int) or isinstance(required, bool) or not 1 <= required <= 10:
        errors.append("required: an integer from 1 to 10")
    ttl = spec.get("ttl_seconds", 24 * 3600)
    if not isinstance(ttl, int) or isinstance(ttl, bool) or not 60 <= ttl <= 30 * 24 * 3600:
        errors.append("ttl_seconds: an integer from 60 to 2592000")
    if spec.get("on_expiry", "reject") not in OnExpiry.__members__.values():
        errors.append(f"on_expiry: one of {', '.join(OnExpiry)}")
    return errors


TOOL_KEYS = {
    "name",
    "version",
    "description",
    "effect",
    "argument_schema",
    "sensitive_fields",
    "approval",
    "timeout",
    "allowed_groups",
    "precondition",
}


def _tool_errors(spec: Any) -> list[str]:
    if not isinstance(spec, dict):
        return ["must be an object"]
    errors = []
    unknown = set(spec) - TOOL_KEYS
    if unknown:
        errors.append(f"unknown keys: {', '.join(sorted(unknown))}")
    name = spec.get("name")
    if (
        not isinstance(name, str)
        or not 1 <= len(name) <= TOOL_NAME_MAX
        or SEP in name
        or not name.isprintable()
    ):
        errors.append(f"name: 1 to {TOOL_NAME_MAX} printable characters, no '{SEP}'")
    if spec.get("effect") not in Effect.__members__.values():
        errors.append(f"effect: one of {', '.join(Effect)}")
    version = spec.get("version", "")
    if not isinstance(version, str) or len(version) > 64:
        errors.append("version: a string of at most 64 characters")
    errors += [f"argument_schema: {e}" for e in _schema_errors(spec.get("argument_schema", {}))]
    sensitive = spec.get("sensitive_fields", [])
    if not isinstance(sensitive, list) or not all(isinstance(s, str) for s in sensitive):
        errors.append("sensitive_fields: a list of argument names")
    timeout = spec.get("timeout", 10.0)
    if (
        not isinstance(timeout, int | float)
        or isinstance(timeout, bool)
        or not 0 < timeout <= 24 * 3600
    ):
        errors.append("timeout: seconds, more than 0 and at most 86400")
    groups = spec.get("allowed_groups", [])
    if not isinstance(groups, list) or not all(isinstance(g, str) for g in groups):
        errors.append("allowed_groups: a list of group names")
    if not isinstance(spec.get("precondition", False), bool):
        errors.append("precondition: true or false")
    errors += [f"approval: {e}" for e in _policy_errors(spec.get("approval"))]
    return errors


def manifest_validate(data: Any) -> dict[str, Any]:
    """The manifest's shape, every JSON schema, effect classes and approval policies.
    Returns the normalised manifest; raises ``ManifestInvalid`` with messages per field."""
    if not isinstance(data, dict):
        raise ManifestInvalid({"non_field_errors": ["the manifest must be a JSON object"]})
    problems: dict[str, list[str]] = {}
    unknown = set(data) - {"version", "input_schema", "tools", "migrations"}
    if unknown:
        problems["non_field_errors"] = [f"unknown keys: {', '.join(sorted(unknown))}"]
    version = data.get("version")
    if not isinstance(version, str) or not VERSION.fullmatch(version):
        problems["version"] = ["1 to 50 characters, no control characters"]
    schema_errors = _schema_errors(data.get("input_schema", {"type": "object"}))
    if schema_errors:
        problems["input_schema"] = schema_errors
    tools = data.get("tools", [])
    if not isinstance(tools, list) or len(tools) > 100:
        problems["tools"] = ["a list of at most 100 tools"]
        tools = []
    seen: set[str] = set()
    for index, spec in enumerate(tools):
        errors = _tool_errors(spec)
        if not errors and spec["name"] in seen:
            errors = [f"name: {spec['name']!r} is declared twice"]
        if errors:
            problems[f"tools.{index}"] = errors
        elif isinstance(spec, dict):
            seen.add(spec["name"])
    migrations = data.get("migrations", {})
    if not isinstance(migrations, dict) or not all(
        isinstance(hop, dict)
        and isinstance(hop.get("to"), str)
        and set(hop) <= {"to", "description"}
        and isinstance(hop.get("description", ""), str)
        for hop in migrations.values()
    ):
        problems["migrations"] = ['{"<from version>": {"to": "<version>", "description": "..."}}']
    if problems:
        raise ManifestInvalid(problems)
    return {
        "version": version,
        "input_schema": data.get("input_schema") or {"type": "object"},
        "tools": tools,
        "migrations": migrations,
    }


def _has_null_character(value: Any) -> bool:
    if isinstance(value, str):
        return "\x00" in value
    if isinstance(value, dict):
        return any(_has_null_character(k) or _has_null_character(v) for k, v in value.items())
    if isinstance(value, list):
        return any(_has_null_character(v) for v in value)
    return False


def _manifest_data(manifest: AgentManifest | None) -> dict[str, Any] | None:
    if manifest is None:
        return None
    return {
        "version": manifest.version,
        "input_schema": manifest.input_schema,
        "tools": manifest.tools,
        "migrations": manifest.migrations,
    }


def _is_admin(user: Any) -> bool:
    return bool(
        user is not None
        and user.is_active
        and (user.is_superuser or user.groups.filter(name="admin").exists())
    )


def agent_manifest_put(
    *, name: str, manifest: Any, actor: Actor, request: Any = None
) -> tuple[AgentManifest, bool]:
    """Register or update a remote agent's manifest (admins only), audited with the manifest
    before and after. Returns it and whether it was created. Runs started on an older version
    follow the resume rules when they are next claimed: a declared migration hop lets them
    continue (the process migrates its state), none parks them for a person."""
    from runs.audit import audit_record

    if not _is_admin(actor.user):
        raise PermissionDenied("only admins register remote agents")
    if not isinstance(name, str) or not AGENT_NAME.fullmatch(name):
        raise ManifestInvalid({"name": [AGENT_NAME_RULE]})
    if _has_null_character(manifest):
        # PostgreSQL stores no U+0000 in jsonb: bad input, not a failed insert
        raise ManifestInvalid({"non_field_errors": ["null characters are not allowed"]})
    data = manifest_validate(manifest)
    if name in {agent.name for agent in registry.agents()}:
        raise InvalidState(f"{name!r} is a hosted agent; it cannot be replaced by a manifest")
    with transaction.atomic():
        existing = AgentManifest.objects.select_for_update().filter(name=name).first()
        before = _manifest_data(existing)
        row = existing or AgentManifest(name=name)
        row.version = data["version"]
        row.input_schema = data["input_schema"]
        row.tools = data["tools"]
        row.migrations = data["migrations"]
        row.registered_by = actor.label
        row.save()
        if before != data:
            audit_record(
                action="agent.registered" if existing is None else "agent.updated",
                actor=actor.label,
                channel=actor.channel,
                request=request,
                object_type="agent",
                object_id=name,
                before=before,
                after=data,
            )
    return row, existing is None


# --- the lease ----------------------------------------------------------------------------------


@dataclass
class RemoteLease(engine.Lease):
    """The engine's ``Lease`` for an agent process: events name the API actor, and every
    write also requires the run still to be ``running`` (a released or expired lease keeps
    its fence until the next claim)."""

    @property
    def actor(self) -> str:
        return self.worker

    @contextmanager
    def checkpoint(self, *, locked: Run | None = None):
        with checkpoint(
            self.run.id, actor=self.actor, channel="api", fence=self.fence, locked=locked
        ) as cp:
            if cp.run.status != Run.Status.RUNNING:
                raise LeaseLost(
                    f"run {self.run.id} is {cp.run.status}: this lease was released; claim it again"
                )
            yield cp
        self.take_operator_changes(cp.run)


def _owner(actor: Actor, owner: str) -> str:
    return f"{actor.label}#{owner}"[:200] if owner else actor.label[:200]


def _require_remote(run_id: Any) -> Run:
    run = Run.objects.filter(id=run_id).only("id", "agent_name").first()
    if run is None:
        raise RunNotFound(f"run {run_id} does not exist")
    if not is_remote(run.agent_name):
        raise InvalidState(
            f"{run.agent_name} is a hosted agent: its runs are advanced by workers, not leased"
        )
    return run


def _held(run_id: Any, fence: int, actor: Actor) -> RemoteLease:
    """The caller's lease, rebuilt from the record; ``LeaseLost`` unless ``fence`` is the
    current incarnation's and its lease is live."""
    actor.require("runs.operate_run")
    _require_remote(run_id)
    run = (
        Run.objects.select_related("principal")
        .filter(id=run_id, fence=fence, status=Run.Status.RUNNING, lease_expires_at__gt=Now())
        .first()
    )
    if run is None:
        raise LeaseLost(f"fence {fence} does not hold run {run_id}'s lease; claim it again")
    return RemoteLease(
        run=run,
        fence=fence,
        worker=run.lease_owner or actor.label,
        recovered=False,
        agent=registry.agent(run.agent_name),
        steps=list(Step.objects.filter(run_id=run_id).order_by("seq")),
        claimed_db_time=db_now(),
    )


def _honour_request(lease: RemoteLease) -> None:
    """An operator asked to pause or terminate while this process held the lease: honoured
    at this boundary (after any receipt), and the process is told its lease is gone."""
    if not lease.run.requested_action:
        return
    action, by = lease.run.requested_action, lease.run.requested_by
    if engine._honour_request(lease):
        raise LeaseLost(f"{by} asked to {action} the run: the lease is released")


def _check_budget(lease: RemoteLease) -> None:
    exhausted = engine._budget_exhausted(lease)
    if exhausted:
        engine._park_needs_attention(lease, Run.Reason.BUDGET_EXHAUSTED, exhausted)
        raise BudgetExhausted(exhausted + "; the run now needs a person (top up its budget)")


def _open_step_call(lease: RemoteLease) -> tuple[Step, ToolCall] | None:
    step = lease.open_step()
    if step is None or step.kind != Step.Kind.TOOL_CALL:
        return None
    return step, ToolCall.objects.select_related("step").get(step=step)


def _settle_open_step(lease: RemoteLease) -> None:
    """At claim, as the engine does in ``_continue_step``: a call left in flight by an earlier
    incarnation becomes ``unknown`` (never silently dispatched again); a rejected or
    cancelled one fails its step; a receipt recorded without its step completing completes
    it; a retired or changed tool follows the engine's rules. An ``unsafe`` unknown outcome
    goes to a person. An open wait (claimed because its timer or timeout fell due before the
    sweeper ended it) ends here as the engine's ``_continue_wait`` ends it, or parks again."""
    step = lease.open_step()
    if step is not None and step.kind == Step.Kind.WAIT:
        engine._continue_wait(lease, step)
        return
    found = _open_step_call(lease)
    if found is None:
        return
    step, call = found
    try:
        tool = registry.tool(call.tool_name)
    except UnknownTool:
        tool = None
    if tool is None or tool.version != call.tool_version:
        engine._tool_changed(lease, step, call, tool)
        return
    if call.status == ToolCall.Status.DISPATCHING:
        engine._mark_unknown(
            lease, call, f"left in dispatching by incarnation {call.dispatch_incarnation}"
        )
    if call.status == ToolCall.Status.UNKNOWN and tool.effect == Effect.UNSAFE:
        engine._park_needs_attention(
            lease,
            Run.Reason.UNKNOWN_OUTCOME,
            f"{tool.name} (unsafe) may or may not have acted: {call.last_error}",
        )
    elif call.status == ToolCall.Status.REJECTED:
        engine._fail_step(lease, step, f"approval rejected: {call.last_error}".rstrip(": "))
    elif call.status == ToolCall.Status.CANCELLED:
        engine._fail_step(lease, step, "tool call cancelled")
    elif call.status in (ToolCall.Status.SUCCEEDED, ToolCall.Status.FAILED):
        receipt = ToolReceipt.objects.get(tool_call=call)
        with lease.checkpoint() as cp:
            engine._complete_step(
                cp,
                lease,
                step,
                call,
                receipt.outcome == ToolReceipt.Outcome.SUCCEEDED,
                receipt.result,
                "",
            )


@dataclass(frozen=True)
class LeaseGrant:
    run_id: Any
    fence: int
    lease_expires_at: datetime
    resume: dict[str, Any]

    @property
    def lease_ttl_seconds(self) -> float:
        return float(settings.AGENTOPS["LEASE_TTL"])


def remote_lease_acquire(*, run_id: Any, actor: Actor, owner: str = "") -> LeaseGrant:
    """Claim a remote run's lease with the engine's compare-and-set. ``LeaseHeld`` when
    another process holds a live lease; ``InvalidState`` when the run is not runnable. The
    resume checks of DESIGN §5 run here, before the process decides anything."""
    actor.require("runs.operate_run")
    _require_remote(run_id)
    lease = engine.claim(run_id, worker=_owner(actor, owner), remote=True, lease_type=RemoteLease)
    if lease is None:
        run = Run.objects.get(id=run_id)
        if run.status == Run.Status.RUNNING and run.lease_expires_at is not None:
            raise LeaseHeld(
                f"{run.lease_owner} holds the lease until {run.lease_expires_at.isoformat()}"
            )
        raise InvalidState(f"the run is {run.status}; only a queued or running run is leased")
    lease = cast(RemoteLease, lease)
    if lease.run.reason_detail == WAITING_FOR_PROCESS:
        with lease.checkpoint() as cp:
            cp.update(reason_detail="")
    if lease.agent is None:
        engine._park_needs_attention(
            lease,
            Run.Reason.INCOMPATIBLE_AGENT_VERSION,
            f"agent {lease.run.agent_name!r} is not registered",
        )
    else:
        migrated_from = lease.run.agent_version
        if engine._migrate_agent_version(lease):
            recoveries = lease.run.recovery_count - lease.run.recovery_count_at_retry
            if recoveries > settings.AGENTOPS["MAX_RECOVERIES"]:
                engine._park_needs_attention(
                    lease,
                    Run.Reason.RECOVERY_LIMIT,
                    f"recovered {recoveries} times (limit {settings.AGENTOPS['MAX_RECOVERIES']})",
                )
            else:
                revoked = engine._principal_refusal(lease, tool=None)
                if revoked:
                    engine._pause_principal_revoked(lease, revoked)
                else:
                    _settle_open_step(lease)
    run = Run.objects.get(id=run_id)
    if run.status == Run.Status.WAITING_EVENT:
        raise InvalidState(
            "the run is waiting_event: nothing has ended its wait yet (the run.wait_ended "
            "webhook says when something does)"
        )
    if run.status != Run.Status.RUNNING or run.fence != lease.fence:
        raise InvalidState(
            f"the run is {run.status} ({run.reason_code}): {run.reason_detail}".strip(": ")
        )
    packet = resume_packet(run)
    if lease.agent is not None and migrated_from != run.agent_version:
        packet["migrated_from"] = migrated_from
        packet["migrations"] = [
            {"from": source, "to": target, "description": lease.agent.migration_notes.get(source)}
            for source, target, _fn in lease.agent.migration_path(migrated_from) or []
        ]
    return LeaseGrant(
        run_id=run.id, fence=run.fence, lease_expires_at=run.lease_expires_at, resume=packet
    )


def _call_data(run: Run, call: ToolCall) -> dict[str, Any]:
    approval = None
    approvals = getattr(call, "approvals", None)
    if approvals is not None:
        live = [a for a in approvals.all() if a.status in ("pending", "approved")]
        approval = live[-1].id if live else None
    return {
        "id": call.id,
        "step_seq": call.step.seq,
        "tool": short_tool_name(run.agent_name, call.tool_name),
        "tool_version": call.tool_version,
        # the lease holder made these arguments and needs them to call or look up the tool
        "arguments": call.arguments,
        "status": call.status,
        "idempotency_key": call.idempotency_key,
        "attempt_count": call.attempt_count,
        "dispatched_at": call.dispatched_at.isoformat() if call.dispatched_at else None,
        "last_error": call.last_error,
        "approval": approval,
    }


def wait_outcomes(steps: list[Step]) -> dict[int, dict[str, Any]]:
    """How each finished wait among ``steps`` ended (by step id), read from the record: the
    signal it consumed, its question's answer, its timer, or its timeout (the output is then
    the wait's declared default). Two queries, whatever the number of waits."""
    finished = {
        step.id: step
        for step in steps
        if step.kind == Step.Kind.WAIT and step.status == Step.Status.COMPLETED
    }
    if not finished:
        return {}
    signals = {
        signal.consumed_by_step_id: signal
        for signal in Signal.objects.filter(consumed_by_step_id__in=finished)
    }
    questions = {
        question.step_id: question
        for question in Question.objects.filter(step_id__in=finished).select_related("answered_by")
    }
    outcomes = {}
    for step_id, step in finished.items():
        kind = step.input.get("wait")
        signal, question = signals.get(step_id), questions.get(step_id)
        outcome: dict[str, Any] = {
            "kind": kind,
            "ended_by": "timeout",
            "timed_out": True,
            "signal_id": None,
            "question_id": question.id if question is not None else None,
            "answered_by": None,
        }
        if signal is not None:
            outcome.update(ended_by="signal", timed_out=False, signal_id=signal.id)
        elif question is not None and question.status == Question.Status.ANSWERED:
            outcome.update(
                ended_by="answer",
                timed_out=False,
                answered_by=question.answered_by.get_username() if question.answered_by else None,
            )
        elif kind == "timer":
            outcome.update(ended_by="timer", timed_out=False)
        outcomes[step_id] = outcome
    return outcomes


def resume_packet(run: Run) -> dict[str, Any]:
    """What a process needs to continue a run: state, completed steps (a wait with how it
    ended), open tool calls with their status, unknown outcomes to reconcile, approvals
    still pending."""
    steps = list(Step.objects.filter(run_id=run.id).order_by("seq"))
    ended_waits = wait_outcomes(steps)
    calls = list(
        ToolCall.objects.filter(run_id=run.id, status__in=ToolCall.OPEN)
        .select_related("step")
        .prefetch_related("approvals")
        .order_by("step__seq")
    )
    open_calls = [_call_data(run, call) for call in calls]
    return {
        "run": str(run.id),
        "agent": run.agent_name,
        "agent_version": run.agent_version,
        "goal": run.goal,
        "input": run.input,
        "state": run.state,
        "state_version": run.state_version,
        "recovery_count": run.recovery_count,
        "steps": [
            {
                "seq": step.seq,
                "kind": step.kind,
                "status": step.status,
                "input": step.input,
                "output": step.output,
                "error": step.error,
                "wait": ended_waits.get(step.id),
            }
            for step in steps
            if step.status != Step.Status.PENDING
        ],
        "open_tool_calls": open_calls,
        "unknown_outcomes": [c for c in open_calls if c["status"] == ToolCall.Status.UNKNOWN],
        "pending_approvals": [
            {"id": c["approval"], "tool_call": c["id"]}
            for c in open_calls
            if c["status"] == ToolCall.Status.AWAITING_APPROVAL and c["approval"]
        ],
        "migrated_from": None,
        "migrations": [],
    }


def remote_lease_heartbeat(*, run_id: Any, fence: int, actor: Actor) -> Run:
    """Extend the lease by its TTL. Pause and terminate requests are reported
    (``requested_action``), to be honoured after any call in flight has its receipt."""
    lease = _held(run_id, fence, actor)
    with lease.checkpoint() as cp:
        cp.update(lease_expires_at=engine.lease_expiry_expression())
    return Run.objects.get(id=run_id)


def remote_lease_release(*, run_id: Any, fence: int, actor: Actor) -> Run:
    """Give the lease back; the run waits (``queued``) for an agent process."""
    lease = _held(run_id, fence, actor)
    if not engine._honour_request(lease):
        engine._release(lease)
    return Run.objects.get(id=run_id)


def _replayed_step(
    run_id: Any, fence: int, seq: int, kind: str, same: Callable[[Step], bool]
) -> Step | None:
    """A retried request whose first commit went through but whose answer was lost: the
    step this incarnation already recorded at ``seq``, if it is the same decision."""
    step = Step.objects.filter(run_id=run_id, seq=seq, incarnation=fence, kind=kind).first()
    return step if step is not None and same(step) else None


def _next_seq(lease: RemoteLease, expected: int | None) -> int:
    seq = (lease.steps[-1].seq + 1) if lease.steps else 1
    if expected is not None and expected != seq:
        raise InvalidState(f"the run's next step is {seq}, not {expected}")
    return seq


@dataclass(frozen=True)
class StepRecorded:
    step: Step
    replayed: bool  # a retried request: the step its first attempt recorded


def remote_step_record(
    *,
    run_id: Any,
    fence: int,
    actor: Actor,
    input: Any = None,
    output: Any = None,
    state: Any = None,
    cost: Any = 0,
    tokens: int = 0,
    seq: int | None = None,
) -> StepRecorded:
    """``decided`` + ``step_completed`` for the process's own work (a model call, a plan):
    the step, its usage and the new state in one commit, so a successor resumes after it.

    ``seq`` (optional) is the step number the process expects: a retry of a request that
    was recorded (same fence, seq, input and output) returns that step and records nothing;
    any other ``seq`` than the next one is ``InvalidState``. Without it every request is a
    new step (two identical decisions in a row may be meant)."""
    input = input if input is not None else {}
    if seq is not None:
        actor.require("runs.operate_run")
        _require_remote(run_id)
        replayed = _replayed_step(
            run_id,
            fence,
            seq,
            DECISION,
            lambda step: (
                digest(step.input) == digest(input) and digest(step.output) == digest(output)
            ),
        )
        if replayed is not None:
            return StepRecorded(replayed, True)
    lease = _held(run_id, fence, actor)
    _honour_request(lease)
    if lease.open_step() is not None:
        raise InvalidState("a tool call step is still open: record its receipt first")
    seq = _next_seq(lease, seq)
    _check_budget(lease)
    with lease.checkpoint() as cp:
        step = Step.objects.create(
            run_id=run_id,
            seq=seq,
            kind=DECISION,
            status=Step.Status.COMPLETED,
            input=input,
            output=output,
            incarnation=fence,
            cost=cost or 0,
            tokens=tokens or 0,
            completed_at=timezone.now(),
        )
        cp.event("step.decided", seq=seq, kind=DECISION, cost=cost, tokens=tokens)
        updates: dict[str, Any] = {
            "steps_used": F("steps_used") + 1,
            "cost_used": F("cost_used") + (cost or 0),
            "tokens_used": F("tokens_used") + (tokens or 0),
        }
        if state is not None:
            updates.update(state=state, state_version=F("state_version") + 1)
        cp.update(**updates)
        cp.boundary("decided")
        cp.boundary("step_completed")
    return StepRecorded(step, False)


@dataclass(frozen=True)
class Proposal:
    decision: str  # approved | awaiting_approval | refused | paused | unknown | succeeded
    step: Step
    call: ToolCall | None
    approval_id: int | None
    error: str
    replayed: bool = False  # a retried request: the call its first attempt proposed


def _proposal(run_id: Any, step: Step, call: ToolCall | None, *, replayed: bool) -> Proposal:
    """What the tool's policy decided for this call, read from the record."""
    if call is None:
        return Proposal("refused", step, None, None, step.error, replayed)
    if call.status == ToolCall.Status.AWAITING_APPROVAL:
        approval = call.approvals.filter(status="pending").order_by("-id").first()
        approval_id = approval.id if approval else None
        return Proposal("awaiting_approval", step, call, approval_id, "", replayed)
    if Run.objects.filter(id=run_id, status=Run.Status.PAUSED).exists():
        return Proposal("paused", step, call, None, "the principal may not use this tool", replayed)
    if call.status == ToolCall.Status.UNKNOWN:
        # a fork's family already dispatched this key: reconcile it, never send it blindly
        return Proposal("unknown", step, call, None, call.last_error, replayed)
    if call.status == ToolCall.Status.SUCCEEDED:
        return Proposal("succeeded", step, call, None, "", replayed)
    return Proposal("approved", step, call, None, "", replayed)


# Where a propose itself leaves a run when it releases the lease: waiting for the approval,
# or paused because the principal may not use the tool.
_PARKED_BY_PROPOSE = (Run.Status.WAITING_APPROVAL, Run.Status.PAUSED)


def _replayed_proposal(
    run_id: Any, fence: int, tool: str, arguments: Any, *, statuses: tuple[str, ...]
) -> Proposal | None:
    """A retried propose (same fence, tool and arguments) whose first attempt's answer was
    lost: that attempt's call, still open and never dispatched, is the run's last step."""
    run = (
        Run.objects.filter(id=run_id, fence=fence, status__in=statuses)
        .only("id", "agent_name")
        .first()
    )
    if run is None:
        return None
    step = Step.objects.filter(run_id=run_id).order_by("-seq").first()
    if (
        step is None
        or step.kind != Step.Kind.TOOL_CALL
        or step.status != Step.Status.PENDING
        or step.incarnation != fence
    ):
        return None
    call = ToolCall.objects.select_related("step").filter(step=step).first()
    if (
        call is None
        or call.attempt_count
        or call.tool_name != f"{run.agent_name}{SEP}{tool}"
        or call.arguments_digest != digest(arguments)
    ):
        return None
    return _proposal(run_id, step, call, replayed=True)


def remote_toolcall_propose(
    *,
    run_id: Any,
    fence: int,
    actor: Actor,
    tool: str,
    arguments: Any,
    precondition: str = "",
) -> Proposal:
    """``decided``: the call is recorded as a step with its idempotency key, and the tool's
    policy decides — ``approved`` (dispatch it), ``awaiting_approval`` (the lease is released
    until a person decides; the approval.decided webhook says when), or ``refused`` (not the
    agent's tool, or arguments that break the schema: a failed step the agent sees).

    A retry by the same incarnation of a propose that was recorded (same tool and arguments,
    the call still open and not dispatched) gets the same proposal (``replayed``), also when
    the first attempt released the lease to wait for an approval. Another call while one is
    open is ``InvalidState``."""
    if not isinstance(arguments, dict):
        raise InvalidInput("arguments must be a JSON object")
    try:
        lease = _held(run_id, fence, actor)
    except LeaseLost:
        # the first attempt may have released the lease itself (an approval is needed)
        replayed = _replayed_proposal(run_id, fence, tool, arguments, statuses=_PARKED_BY_PROPOSE)
        if replayed is None:
            raise
        return replayed
    if lease.open_step() is not None:
        replayed = _replayed_proposal(
            run_id, fence, tool, arguments, statuses=(Run.Status.RUNNING,)
        )
        if replayed is not None:
            return replayed
    _honour_request(lease)
    if lease.open_step() is not None:
        raise InvalidState("a tool call is still open: record its receipt before the next one")
    _check_budget(lease)
    seq = (lease.steps[-1].seq + 1) if lease.steps else 1
    token = _reported_fingerprint.set(precondition or "")
    try:
        engine._decide_call(
            lease, CallTool(f"{lease.run.agent_name}{SEP}{tool}", arguments), seq, execute=False
        )
    finally:
        _reported_fingerprint.reset(token)
    step = lease.steps[-1]
    call = ToolCall.objects.select_related("step").filter(step=step).first()
    return _proposal(run_id, step, call, replayed=False)


@dataclass(frozen=True)
class Dispatch:
    go: bool
    call: ToolCall
    reason: str


def _call_for_lease(tool_call_id: Any, fence: int, actor: Actor) -> tuple[RemoteLease, ToolCall]:
    call = ToolCall.objects.select_related("step").filter(id=tool_call_id).first()
    if call is None:
        raise ToolCall.DoesNotExist(f"tool call {tool_call_id} does not exist")
    lease = _held(call.run_id, fence, actor)
    return lease, call


def remote_toolcall_dispatch(
    *, tool_call_id: Any, fence: int, actor: Actor, precondition: str = ""
) -> Dispatch:
    """``dispatching`` through the engine's own ``_dispatch``: attempt incremented, the
    approval consumed, the precondition re-checked, in one commit before the side effect.
    ``go`` is false when the engine refused (approval needed again, precondition changed):
    the call's status says what happened. An unknown outcome is dispatched again only when
    the tool is read or idempotent, or after reconciliation found it absent (or an operator
    chose "dispatch again") and the original request can no longer land."""
    lease, call = _call_for_lease(tool_call_id, fence, actor)
    _honour_request(lease)
    step = lease.open_step()
    if step is None or step.id != call.step_id:
        raise InvalidState(f"the call is {call.status}; it is not the run's open step")
    if call.status == ToolCall.Status.DISPATCHING and call.dispatch_incarnation == fence:
        return Dispatch(True, call, "already dispatching (a retried request)")
    try:
        tool = registry.tool(call.tool_name)
    except UnknownTool:
        tool = None
    if tool is None or tool.version != call.tool_version:
        engine._tool_changed(lease, step, call, tool)
        call.refresh_from_db()
        return Dispatch(False, call, "the tool changed since the call was proposed")
    if call.status == ToolCall.Status.UNKNOWN:
        if tool.effect not in (Effect.READ, Effect.IDEMPOTENT) and not call.redispatch_authorized:
            raise InvalidState(
                "the outcome is unknown: reconcile it by its idempotency key and record a "
                "receipt (found), or report it absent, before dispatching it again"
            )
        can_land_until = engine._can_land_until(lease, call, tool)
        if tool.effect not in (Effect.READ, Effect.IDEMPOTENT) and lease.now() < can_land_until:
            raise InvalidState(
                "the original request may still land until "
                f"{can_land_until.isoformat()}; dispatch again after that"
            )
    elif call.status not in (ToolCall.Status.PROPOSED, ToolCall.Status.APPROVED):
        raise InvalidState(f"the call is {call.status}; it cannot be dispatched")
    token = _reported_fingerprint.set(precondition or "")
    try:
        engine._dispatch(lease, step, call, tool, execute=False)
    finally:
        _reported_fingerprint.reset(token)
    call.refresh_from_db()
    if call.status == ToolCall.Status.DISPATCHING:
        return Dispatch(True, call, "")
    if call.status == ToolCall.Status.AWAITING_APPROVAL:
        return Dispatch(False, call, "the call needs an approval again; the lease is released")
    if call.status == ToolCall.Status.CANCELLED:
        return Dispatch(False, call, "the precondition changed: the call is cancelled")
    return Dispatch(False, call, f"the call is {call.status}")


RECEIPT_OUTCOMES = ("succeeded", "failed", "unknown", "absent")


def remote_toolcall_receipt(
    *,
    tool_call_id: Any,
    fence: int,
    actor: Actor,
    outcome: str,
    result: Any = None,
    external_ref: str = "",
    source: str = ToolReceipt.Source.AGENT,
    state: Any = None,
) -> ToolCall:
    """``receipt_recorded`` + ``step_completed`` in one commit. ``source`` is ``agent`` (the
    tool answered) or ``reconciliation`` (a lookup by idempotency key answered).
    ``unknown``: the call timed out or failed ambiguously, reconcile it next. ``absent``
    (reconciliation only): the key was looked up and reliably not found; the call may be
    dispatched again with the same key once the original request can no longer land.
    A pause or terminate request is honoured right after the receipt is recorded."""
    if outcome not in RECEIPT_OUTCOMES:
        raise InvalidInput(f"outcome must be one of {', '.join(RECEIPT_OUTCOMES)}")
    if source not in (ToolReceipt.Source.AGENT, ToolReceipt.Source.RECONCILIATION):
        raise InvalidInput("source must be agent or reconciliation")
    lease, call = _call_for_lease(tool_call_id, fence, actor)
    receipt = getattr(call, "receipt", None)
    if receipt is not None:
        if receipt.outcome == outcome and receipt.source == source:
            return call  # a retried request: recorded once
        raise InvalidState(f"the call already has a {receipt.outcome} receipt")
    reconciling = source == ToolReceipt.Source.RECONCILIATION
    if reconciling and call.status not in (ToolCall.Status.UNKNOWN, ToolCall.Status.DISPATCHING):
        raise InvalidState(f"the call is {call.status}: there is nothing to reconcile")
    if not reconciling and call.status != ToolCall.Status.DISPATCHING:
        raise InvalidState(f"the call is {call.status}; only a dispatched call gets a receipt")
    if outcome == "absent" and not reconciling:
        raise InvalidInput("absent is what a reconciliation lookup reports")
    step = call.step
    if outcome == "unknown":
        if reconciling:
            with lease.checkpoint() as cp:
                attempt = call.reconcile_attempts + 1
                ToolCall.objects.filter(id=call.id).update(reconcile_attempts=attempt)
                cp.event(
                    "tool.reconcile_attempted",
                    seq=step.seq,
                    attempt=attempt,
                    outcome="unknown",
                    detail=str(result or "")[:2000],
                )
        else:
            engine._mark_unknown(lease, call, str(result or "outcome unknown")[:2000])
            if call.effect == Effect.UNSAFE:
                engine._park_needs_attention(
                    lease,
                    Run.Reason.UNKNOWN_OUTCOME,
                    f"{call.tool_name} (unsafe) may or may not have acted: {call.last_error}",
                )
        call.refresh_from_db()
        return call
    if outcome == "absent":
        with lease.checkpoint() as cp:
            attempt = call.reconcile_attempts + 1
            ToolCall.objects.filter(id=call.id).update(
                status=ToolCall.Status.UNKNOWN,
                reconcile_attempts=attempt,
                redispatch_authorized=True,
                updated_at=timezone.now(),
            )
            cp.event("tool.reconcile_attempted", seq=step.seq, attempt=attempt, outcome="absent")
        call.refresh_from_db()
        return call
    ok = outcome == "succeeded"
    with lease.checkpoint() as cp:
        if reconciling:
            attempt = call.reconcile_attempts + 1
            ToolCall.objects.filter(id=call.id).update(
                reconcile_attempts=attempt, next_reconcile_at=None
            )
            cp.event(
                "tool.reconcile_attempted",
                seq=step.seq,
                attempt=attempt,
                outcome="found" if ok else "failed",
            )
        engine._record_receipt(
            cp, lease, call, ok=ok, result=result, external_ref=external_ref, source=source
        )
        engine._complete_step(
            cp, lease, step, call, ok, result if ok else None, "" if ok else str(result)[:2000]
        )
        if state is not None:
            cp.update(state=state, state_version=F("state_version") + 1)
    engine._honour_request(lease)
    call.refresh_from_db()
    return call


def remote_run_finish(
    *,
    run_id: Any,
    fence: int,
    actor: Actor,
    status: str = Run.Status.SUCCEEDED,
    result: Any = None,
    reason: str = "",
) -> Run:
    """``run_finished``: the process ends the run, succeeded (with a result) or failed (with
    a reason); the lease is released with it."""
    if status not in (Run.Status.SUCCEEDED, Run.Status.FAILED):
        raise InvalidInput("status must be succeeded or failed")
    if status == Run.Status.FAILED and not (reason or "").strip():
        raise InvalidInput("a failed run needs a reason")
    lease = _held(run_id, fence, actor)
    _honour_request(lease)
    if lease.open_step() is not None:
        raise InvalidState("a tool call step is still open: record its receipt first")
    seq = (lease.steps[-1].seq + 1) if lease.steps else 1
    if status == Run.Status.SUCCEEDED:
        engine._finish(lease, status, result=result, seq=seq)
    else:
        engine._finish(lease, status, reason=Run.Reason.AGENT_FAILED, detail=reason, seq=seq)
    return Run.objects.get(id=run_id)


# --- waits (docs/waits.md, docs/remote-agents.md) ------------------------------------------------

WAIT_KINDS = ("signal", "timer", "question")


@dataclass(frozen=True)
class WaitBegun:
    step: Step
    waiting: bool  # parked: the lease is released until something ends the wait
    question_id: int | None
    outcome: dict[str, Any] | None  # how it ended, when it ended at once (else None)
    replayed: bool = False  # a retried request: the wait its first attempt began


def _wait_begun(step: Step, *, replayed: bool) -> WaitBegun:
    question_id = (
        Question.objects.filter(step=step).values_list("id", flat=True).first()
        if step.input.get("wait") == "question"
        else None
    )
    return WaitBegun(
        step=step,
        waiting=step.status == Step.Status.PENDING,
        question_id=question_id,
        outcome=wait_outcomes([step]).get(step.id),
        replayed=replayed,
    )


def _same_wait(step: Step, action: WaitForSignal | Sleep | AskQuestion) -> bool:
    # deadlines are computed from the clock at the time of the request: not compared
    spec, _wake_at = waits.spec(action, timezone.now())
    volatile = ("deadline", "until")
    return {k: v for k, v in step.input.items() if k not in volatile} == {
        k: v for k, v in spec.items() if k not in volatile
    }


def remote_wait_begin(
    *,
    run_id: Any,
    fence: int,
    actor: Actor,
    action: WaitForSignal | Sleep | AskQuestion,
    seq: int | None = None,
) -> WaitBegun:
    """A remote agent's durable wait, through the engine's own ``_decide_wait``: the wait
    step (``decided``), its question (emailed after the commit), and — unless the wait can
    end at once — ``run.waiting`` with the run parked in ``waiting_event``, ``wake_at`` set
    and the lease released, all in one commit. A signal that arrived before the wait began,
    or a time already come, ends it in that same commit: the lease is then still the
    process's and ``outcome`` says how it ended.

    An invalid wait is ``InvalidInput`` and writes nothing (a hosted agent gets a failed
    step instead: a process can correct its request). ``seq`` (optional) makes a retry safe
    as for steps: the same wait at that seq by this incarnation is returned as it stands."""
    if not isinstance(action, WaitForSignal | Sleep | AskQuestion):
        raise InvalidInput("a wait is a signal, a timer or a question")
    if seq is not None:
        actor.require("runs.operate_run")
        _require_remote(run_id)
        replayed = _replayed_step(
            run_id, fence, seq, Step.Kind.WAIT, lambda step: _same_wait(step, action)
        )
        if replayed is not None:
            return _wait_begun(replayed, replayed=True)
    error = waits.validate(action)
    if error:
        raise InvalidInput(error)
    lease = _held(run_id, fence, actor)
    _honour_request(lease)
    if lease.open_step() is not None:
        raise InvalidState("a tool call is still open: record its receipt before waiting")
    seq = _next_seq(lease, seq)
    _check_budget(lease)
    engine._decide_wait(lease, action, seq)
    return _wait_begun(lease.steps[-1], replayed=False)


def remote_wait_end(cp: Checkpoint, *, step: Step, agent: Agent) -> bool:
    """End a remote run's wait inside ``cp`` (the run row locked, no lease held), if what
    arrived or the clock allows it. No worker ever claims a remote run, so whatever ends its
    wait ends it right there — a signal or an answer in the service's own commit
    (``runs.waits``), the timer or the timeout in the sweeper's (``remote_waits_end_due``) —
    exactly as the engine ends a hosted run's wait at claim (``waits.end_wait_if_due``):
    the step completes with its outcome, a signal is consumed in the same commit, and
    ``run.wait_ended`` or ``run.wait_timed_out`` is recorded (its webhook, ``run.wait_ended``,
    wakes a process that exited). The run is then ``queued``, waiting for an agent process,
    whose next lease finds the finished wait in its resume packet."""
    run = Run.objects.get(id=cp.run.id)
    if not waits.end_wait_if_due(cp, run=run, agent=agent, step=step, now=db_now()):
        return False
    cp.update(
        status=Run.Status.QUEUED,
        wake_at=None,
        enqueued_at=None,
        reason_detail=WAITING_FOR_PROCESS,
    )
    return True


def remote_waits_end_due(limit: int = 200) -> int:
    """A sweep hook: remote runs whose timer or wait timeout fell due (``wake_at``, database
    time) have their wait ended (``remote_wait_end``) — also timers that fell due while no
    sweeper ran. Returns how many waits ended."""
    due = list(
        Run.objects.filter(
            engine._kind_filter(remote=True),
            status=Run.Status.WAITING_EVENT,
            wake_at__lte=Now(),
        ).values_list("id", "agent_name")[:limit]
    )
    ended = 0
    for run_id, agent_name in due:
        try:
            agent = registry.agent(agent_name)
        except UnknownAgent:
            continue
        with checkpoint(run_id, actor="system", channel="worker") as cp:
            still = Run.objects.filter(
                id=run_id, status=Run.Status.WAITING_EVENT, wake_at__lte=Now()
            ).exists()
            if not still:  # ended, claimed or terminated since we looked
                continue
            step = waits.open_wait_step(run_id)
            if step is not None and remote_wait_end(cp, step=step, agent=agent):
                ended += 1
    return ended


# --- expiry (a sweep hook) -----------------------------------------------------------------------


def remote_leases_expire(limit: int = 200) -> int:
    """Remote runs whose process stopped heartbeating go back to ``queued``, waiting for an
    agent process, with ``run.lease_expired`` (and its webhook). Counted as a recovery."""
    expired = list(
        Run.objects.filter(
            engine._kind_filter(remote=True),
            status=Run.Status.RUNNING,
            lease_expires_at__lt=Now(),
        ).values_list("id", "fence", "lease_owner")[:limit]
    )
    count = 0
    for run_id, fence, owner in expired:
        with checkpoint(run_id, actor="system", channel="worker") as cp:
            still = Run.objects.filter(
                id=run_id, fence=fence, status=Run.Status.RUNNING, lease_expires_at__lt=Now()
            ).exists()
            if not still:  # renewed or claimed again since we looked
                continue
            cp.event("run.lease_expired", owner=owner, fence=fence)
            cp.update(
                status=Run.Status.QUEUED,
                lease_owner="",
                lease_expires_at=None,
                reason_detail=WAITING_FOR_PROCESS,
                recovery_count=F("recovery_count") + 1,
            )
            count += 1
    return count

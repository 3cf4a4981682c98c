"""A remote agent's manifest: validated, stored (``agent_manifest_put``, audited) and seen by
the registry as a ``RemoteAgent`` whose tools are ``Tool`` objects named ``<agent>/<tool>``."""

from __future__ import annotations

import contextvars
import operator
import re
from collections.abc import Callable, Mapping
from typing import Any

import jsonschema
from django.contrib.auth import get_user_model
from django.contrib.auth.models import Group
from django.db import transaction

from runs.actors import Actor, PermissionDenied
from runs.models import AgentManifest
from runs.registry import (
    Agent,
    ApprovalPolicy,
    Effect,
    Limits,
    OnExpiry,
    Reconciliation,
    Resend,
    Tool,
    ToolContext,
    ToolResult,
    path_is_valid,
    registry,
)
from runs.services import InvalidInput, InvalidState

SEP = "/"
MANIFEST_NAME_MAX = 100
# remote agents' names: safe in URLs, logs and tool names (``<agent>/<tool>``)
AGENT_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,99}$"
AGENT_NAME = re.compile(AGENT_NAME_PATTERN[1:-1])
VERSION_PATTERN = r"^[^\x00-\x1f\x7f]{1,50}$"
VERSION = re.compile(VERSION_PATTERN[1:-1])
AGENT_NAME_RULE = "1 to 100 letters, digits, '_', '.' or '-', starting with a letter or digit"
TOOL_NAME_MAX = 60


class ManifestInvalid(InvalidInput):
    def __init__(self, fields: dict[str, list[str]]) -> None:
        super().__init__("The manifest is not valid; see fields.")
        self.fields = fields


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
    # the rule is data from the manifest: the tool's fingerprint covers it, not this code
    when.__fingerprint__ = {"argument": name, "op": op, "value": value}  # type: ignore[attr-defined]
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
# hook, so the engine's own re-check (``dispatch``) compares them.
_reported_fingerprint: contextvars.ContextVar[str] = contextvars.ContextVar(
    "reported_fingerprint", default=""
)


def _remote_only_call(arguments: Mapping[str, Any], ctx: ToolContext) -> ToolResult:
    raise RuntimeError("a remote agent's tool is called by the agent process, not by agentops")


def _remote_only_reconcile(key: str, arguments: Mapping[str, Any]) -> Reconciliation:
    raise RuntimeError("a remote agent's tool is reconciled by the agent process")


def _reported_precondition(arguments: Mapping[str, Any]) -> str:
    return _reported_fingerprint.get()


# A manifest tool's code lives in the agent process: its fingerprint (runs.registry) is the
# manifest's declaration alone (version, schema, effect, sensitive fields, approval rule,
# whether it has a lookup and a precondition), so an upgrade of these stand-ins never looks
# like a changed tool.
_remote_only_call.__fingerprint__ = "remote call"  # type: ignore[attr-defined]
_remote_only_reconcile.__fingerprint__ = "remote lookup"  # type: ignore[attr-defined]
_reported_precondition.__fingerprint__ = "remote precondition"  # type: ignore[attr-defined]


def manifest_tool(agent_name: str, spec: Mapping[str, Any]) -> Tool:
    effect = Effect(spec["effect"])
    return Tool(
        name=f"{agent_name}{SEP}{spec['name']}",
        effect=effect,
        call=_remote_only_call,
        schema=spec.get("argument_schema") or {"type": "object"},
        description=spec.get("description", ""),
        sensitive_fields=tuple(spec.get("sensitive_fields", ())),
        sensitive_output=tuple(spec.get("sensitive_output", ())),
        approval=_policy(spec.get("approval") or {}),
        allowed_groups=tuple(spec.get("allowed_groups", ())),
        timeout=float(spec.get("timeout", 10.0)),
        reconcile=_remote_only_reconcile if effect == Effect.RECONCILABLE else None,
        precondition=_reported_precondition if spec.get("precondition") else None,
        version=str(spec.get("version", "")),
        # what the downstream honours (DESIGN §9), as for hosted tools: None is the effect
        # class's default (the idempotent class deduplicates by key)
        honours_key=spec.get("honours_key"),
        honours_deadline=bool(spec.get("honours_deadline", False)),
        resend=Resend(spec.get("resend", Resend.AUTO)),
        # how much of its downstream the tool may use across all agent processes (runs.flow)
        limits=Limits(**spec["limits"]) if spec.get("limits") else None,
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

    def sensitive_outputs(self) -> dict[str, tuple[str, ...]]:
        # from the manifest at hand: resolving each tool by name would read it again
        return {
            f"{self.name}{SEP}{name}": tuple(spec["sensitive_output"])
            for name, spec in self.tool_specs.items()
            if spec.get("sensitive_output")
        }

    def tools_without_dry_run(self) -> list[str]:
        # the agent process calls its tools itself: a dry run is the "do not execute" flag
        # it is given (docs/remote-agents.md, "Dry runs"), nothing here can call one
        return []

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
    "sensitive_output",
    "approval",
    "timeout",
    "allowed_groups",
    "precondition",
    "honours_key",
    "honours_deadline",
    "resend",
    "limits",
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
    paths = spec.get("sensitive_output", [])
    if not isinstance(paths, list) or not all(path_is_valid(p) for p in paths):
        errors.append(
            'sensitive_output: a list of result paths (dotted keys, "*" for every list item)'
        )
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
    for flag in ("honours_key", "honours_deadline"):
        if not isinstance(spec.get(flag, False), bool):
            errors.append(f"{flag}: true or false")
    if spec.get("resend", Resend.AUTO) not in Resend.__members__.values():
        errors.append(f"resend: one of {', '.join(Resend)}")
    errors += [f"approval: {e}" for e in _policy_errors(spec.get("approval"))]
    errors += [f"limits: {e}" for e in _limits_errors(spec.get("limits"))]
    return errors


_LIMIT_KEYS: dict[str, type | tuple[type, ...]] = {"max_in_flight": int, "rate": (int, float), "per_seconds": (int, float),
               "burst": int, "key_argument": str}  # fmt: skip


def _limits_errors(limits: Any) -> list[str]:
    """A tool's declared limits (docs/agents.md "Limits"): the ``Limits`` fields, typed."""
    if limits is None:
        return []
    if not isinstance(limits, dict):
        return ["an object (max_in_flight, rate, per_seconds, burst, key_argument)"]
    unknown = set(limits) - set(_LIMIT_KEYS)
    if unknown:
        return [f"unknown keys: {', '.join(sorted(unknown))}"]
    for key, kind in _LIMIT_KEYS.items():
        value = limits.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, kind)):
            return [f"{key}: the wrong type"]
    if isinstance(limits.get("key_argument"), str) and len(limits["key_argument"]) > 100:
        return ["key_argument: at most 100 characters"]
    try:
        Limits(**limits)
    except ValueError as exc:
        return [str(exc)]
    return []


def manifest_validate(data: Any) -> dict[str, Any]:
    """The manifest's shape, every JSON schema, effect classes and approval policies.
    Returns the normalised manifest; raises ``ManifestInvalid`` with messages per field."""
    if not isinstance(data, dict):
        raise ManifestInvalid({"non_field_errors": ["the manifest must be a JSON object"]})
    problems: dict[str, list[str]] = {}
    unknown = set(data) - {
        "version",
        "input_schema",
        "tools",
        "migrations",
        "owner",
        "question_groups",
    }
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
    owner = data.get("owner")
    if owner is not None and not (
        isinstance(owner, str) and get_user_model().objects.filter(username=owner).exists()
    ):
        problems["owner"] = ["the username of an existing user (or null: nobody drives its runs)"]
    question_groups = data.get("question_groups", [])
    if not (
        isinstance(question_groups, list)
        and all(isinstance(name, str) for name in question_groups)
        and len(question_groups) <= 20
    ):
        problems["question_groups"] = ["a list of at most 20 group names"]
    else:
        missing = set(question_groups) - set(
            Group.objects.filter(name__in=question_groups).values_list("name", flat=True)
        )
        if missing:
            problems["question_groups"] = [f"no such group: {', '.join(sorted(missing))}"]
    if problems:
        raise ManifestInvalid(problems)
    valid = {
        "version": version,
        "input_schema": data.get("input_schema") or {"type": "object"},
        "tools": tools,
        "migrations": migrations,
        "question_groups": sorted(set(question_groups)),
    }
    if "owner" in data:  # absent: an update keeps the owner it had
        valid["owner"] = owner
    return valid


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
        "question_groups": manifest.question_groups,
        "owner": manifest.owner.get_username() if manifest.owner else None,
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
    from runs.audit.entries import audit_record

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
        # who drives the agent and whom it may ask are grants: only an admin gives them
        # (this function is admins only), and the audit entry records the change
        row.question_groups = data["question_groups"]
        if "owner" in data:
            row.owner = (
                get_user_model().objects.get(username=data["owner"]) if data["owner"] else None
            )
        row.registered_by = actor.label
        row.save()
        after = _manifest_data(row)
        if before != after:
            audit_record(
                action="agent.registered" if existing is None else "agent.updated",
                actor=actor.label,
                channel=actor.channel,
                request=request,
                object_type="agent",
                object_id=name,
                before=before,
                after=after,
            )
    return row, existing is None

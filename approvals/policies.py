"""Approval policies as data: rules in CEL (the Common Expression Language, through
``cel-python``), validated when a version is written and evaluated in order when a call is
decided, dispatched or simulated (docs/approvals.md, "Policies").

A rule is ``{"when": "<CEL>", "decide": "allow" | "deny" | "require_approval", ...}``. The
first rule whose ``when`` is true decides; no rule matching allows the call. CEL has no
side effects, no loops and no access to anything but the names given to it: ``args`` (the
call's arguments), ``principal`` (``name``, ``groups``), ``agent``, ``tool``, ``spend`` (the
run's cost so far, a double) and ``now`` (``hour``, ``minute``, ``weekday`` 1=Monday..7,
``date`` "YYYY-MM-DD", ``time`` "HH:MM") in the policy's time zone.

A rule whose expression fails on a real call (an optional argument absent, a type that
does not match) fails closed: a ``deny`` or ``require_approval`` rule applies, an
``allow`` rule does not.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import datetime
from decimal import Decimal, InvalidOperation
from functools import lru_cache
from typing import Any
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError, available_timezones

import celpy
from celpy import celtypes

from runs.registry import OnExpiry

DECISIONS = ("allow", "deny", "require_approval")
# what a policy may do when an approval expires undecided: the registry's catalogue
ON_EXPIRY = tuple(action.value for action in OnExpiry)
NAMES = ("args", "principal", "agent", "tool", "spend", "now")
MAX_RULES = 50
MAX_EXPRESSION = 1000
MAX_REQUIRED = 10
MIN_TTL = 60
MAX_TTL = 30 * 24 * 3600
DEFAULT_TTL = 24 * 3600
RULE_KEYS = {"when", "decide", "reason", "approval", "name"}
APPROVAL_KEYS = {
    "group",
    "required",
    "from_groups",
    "ttl_seconds",
    "on_expiry",
    "escalate_to",
    "bearer_links",
}


@dataclass(frozen=True)
class Requirement:
    """What a ``require_approval`` rule asks: how many approvers, from which group, for how
    long, what happens at expiry, and whether a link's token alone may decide.

    ``from_groups``: per-group minimums within ``required`` ("two approvers, at least one
    from finance": ``required`` 2, ``from_groups`` (("finance", 1),)). Members of those
    groups may decide too; each approver fills at most one group's seat
    (``approvals.quorum``)."""

    group: str = "approver"
    required: int = 1
    from_groups: tuple[tuple[str, int], ...] = ()
    ttl_seconds: int = DEFAULT_TTL
    on_expiry: str = "reject"
    escalate_to: str = ""
    bearer_links: bool = False

    @classmethod
    def from_rule(cls, spec: dict[str, Any] | None) -> Requirement:
        spec = spec or {}
        return cls(
            group=spec.get("group") or "approver",
            required=int(spec.get("required") or 1),
            from_groups=tuple(sorted((str(g), int(n)) for g, n in minimums_of(spec).items())),
            ttl_seconds=int(spec.get("ttl_seconds") or DEFAULT_TTL),
            on_expiry=spec.get("on_expiry") or "reject",
            escalate_to=spec.get("escalate_to") or "",
            bearer_links=bool(spec.get("bearer_links", False)),
        )

    @property
    def minimums(self) -> dict[str, int]:
        return dict(self.from_groups)

    def describe(self) -> str:
        return describe_quorum(self.group, self.required, self.minimums)

    def as_dict(self) -> dict[str, Any]:
        return {
            "group": self.group,
            "required": self.required,
            "from_groups": self.minimums,
            "ttl_seconds": self.ttl_seconds,
            "on_expiry": self.on_expiry,
            "escalate_to": self.escalate_to,
            "bearer_links": self.bearer_links,
        }


@dataclass(frozen=True)
class Outcome:
    """A version's answer for one call: the decision, the rule that made it (its index from
    1; 0 when no rule matched) and, for ``require_approval``, the requirement."""

    decision: str
    rule: int = 0
    reason: str = ""
    requirement: Requirement | None = None
    error: str = ""

    def describe(self) -> str:
        if self.decision == "require_approval" and self.requirement is not None:
            return f"require approval ({self.requirement.describe()})"
        if self.decision == "deny":
            return f"deny ({self.reason})" if self.reason else "deny"
        return self.decision

    def key(self) -> tuple:
        req = self.requirement
        return (
            self.decision,
            (req.group, req.required, req.from_groups)
            if req is not None and self.decision != "allow"
            else None,
        )


def minimums_of(spec: dict[str, Any] | None) -> dict[str, int]:
    """A rule's ``from_groups`` as {group: minimum} (what validation let through)."""
    value = (spec or {}).get("from_groups") or {}
    if not isinstance(value, dict):
        return {}
    return {
        str(g): n for g, n in value.items() if isinstance(n, int) and not isinstance(n, bool) and n
    }


def describe_quorum(group: str, required: int, minimums: dict[str, int] | None = None) -> str:
    """ "2 approvers from approver or finance, at least 1 from finance" """
    minimums = {g: n for g, n in (minimums or {}).items() if n}
    who = "1 approver" if required == 1 else f"{required} approvers"
    pool = [group, *(g for g in sorted(minimums) if g != group)]
    text = f"{who} from {' or '.join(pool)}"
    if minimums:
        text += ", at least " + " and ".join(f"{n} from {g}" for g, n in sorted(minimums.items()))
    return text


@lru_cache(maxsize=1)
def _environment() -> Any:
    """The CEL environment, built at the first rule compiled: building it builds a parser
    (~0.5 s), which a worker or web process that never evaluates a rule should not pay at
    start-up."""
    return celpy.Environment()


@lru_cache(maxsize=512)
def _program(expression: str) -> Any:
    env = _environment()
    return env.program(env.compile(expression))


def _cel(value: Any) -> Any:
    return celpy.json_to_cel(value)


def activation(
    *, arguments: Any, facts: dict[str, Any], tool: str, time_zone: str
) -> dict[str, Any]:
    """The names a rule can read, from a call's arguments and its recorded facts."""
    at = _parse_time(facts.get("at"))
    local = at.astimezone(_zone(time_zone))
    try:
        spend = float(Decimal(str(facts.get("spend") or 0)))
    except (InvalidOperation, ValueError):
        spend = 0.0
    return {
        "args": _cel(dict(arguments or {})),
        "principal": _cel(
            {"name": facts.get("principal") or "", "groups": list(facts.get("groups") or [])}
        ),
        "agent": celtypes.StringType(facts.get("agent") or ""),
        "tool": celtypes.StringType(tool),
        "spend": celtypes.DoubleType(spend),
        "now": _cel(
            {
                "hour": local.hour,
                "minute": local.minute,
                "weekday": local.isoweekday(),
                "date": local.date().isoformat(),
                "time": local.strftime("%H:%M"),
            }
        ),
    }


def _parse_time(value: Any) -> datetime:
    if isinstance(value, datetime):
        return value
    try:
        parsed = datetime.fromisoformat(str(value))
    except ValueError:
        parsed = None
    if parsed is None or parsed.tzinfo is None:
        from django.utils import timezone

        return timezone.now()
    return parsed


def _zone(name: str) -> ZoneInfo:
    try:
        return ZoneInfo(name or "UTC")
    except (ZoneInfoNotFoundError, ValueError):
        return ZoneInfo("UTC")


def evaluate(
    rules: list[dict[str, Any]],
    *,
    arguments: Any,
    facts: dict[str, Any],
    tool: str,
    time_zone: str = "UTC",
) -> Outcome:
    """The first matching rule's decision (no match: ``allow``)."""
    names = activation(arguments=arguments, facts=facts, tool=tool, time_zone=time_zone)
    for index, rule in enumerate(rules, start=1):
        decision = rule.get("decide", "allow")
        when = (rule.get("when") or "").strip()
        error = ""
        matched: bool | None
        if not when:
            matched = True
        else:
            try:
                result = _program(when).evaluate(names)
                matched = bool(result) if isinstance(result, celtypes.BoolType) else None
                if matched is None:
                    error = "the expression is not true or false"
            except Exception as exc:  # CELEvalError, or a parse error in a stored rule
                matched, error = None, describe_error(exc)
            if matched is None:
                # fails closed: a restrictive rule applies, a permissive one does not
                matched = decision != "allow"
        if not matched:
            continue
        requirement = Requirement.from_rule(rule.get("approval")) if decision != "allow" else None
        return Outcome(
            decision=decision,
            rule=index,
            reason=rule.get("reason", "") if decision == "deny" else "",
            requirement=requirement if decision == "require_approval" else None,
            error=error,
        )
    return Outcome("allow")


_UNDECLARED = re.compile(r"undeclared reference to '([^']+)'")
_NO_MEMBER = re.compile(r"no such member in mapping: '([^']+)'")
_OVERLOAD = re.compile(r"no such overload: (\w+)\(([^)]*)\) <class '[\w.]+\.(\w+)'> != (\w+)")


def describe_error(exc: Exception) -> str:
    """A short, readable message for a CEL error (the library's carry its whole scope)."""
    if isinstance(exc, celpy.CELParseError):
        lines = str(exc).splitlines()
        where = getattr(exc, "column", None)
        position = f" at column {where}" if where else ""
        return f"syntax error{position}: " + (lines[0].strip() if lines else "")
    text = str(exc.args[0] if exc.args else exc)
    if m := _UNDECLARED.search(text):
        return f"unknown name {m.group(1)!r}: a rule can read {', '.join(NAMES)}"
    if m := _NO_MEMBER.search(text):
        return f"no field {m.group(1)!r} (use has(args.{m.group(1)}) for an optional one)"
    if "no matching overload" in text or "no such overload" in text:
        detail = ""
        if m := _OVERLOAD.search(text):
            detail = f": {m.group(3)} against {m.group(4)}"
        return (
            "the types do not match"
            + detail
            + " (compare integers with integers: write 5000, not 50.00, for an amount in "
            "minor units; spend is a double: write 10.0)"
        )
    return text[:300]


def _sample(schema: Any) -> Any:
    kind: Any = schema.get("type") if isinstance(schema, dict) else None
    if isinstance(kind, list):
        kind = next((k for k in kind if k != "null"), None)
    if "enum" in (schema or {}) and schema["enum"]:
        return schema["enum"][0]
    return {
        "integer": 1,
        "number": 1.0,
        "string": "x",
        "boolean": False,
        "array": [],
        "object": {},
    }.get(kind, "x")


def sample_arguments(schema: dict[str, Any] | None) -> dict[str, Any]:
    """Arguments of the right types for every property of a tool's schema: a rule is tried
    on them when it is written, so a misspelt field or a wrong type is an error then, not a
    surprise at the next call."""
    props = (schema or {}).get("properties") or {}
    return {name: _sample(spec) for name, spec in props.items()}


def validate(
    rules: Any,
    *,
    time_zone: str,
    tool_schema: dict[str, Any] | None,
    groups: set[str],
) -> dict[str, list[str]]:
    """Every problem of a version, by field (``rules``, ``rule 2``, ``time_zone``): clear
    messages for people and a machine-readable shape for the API. Empty: valid."""
    errors: dict[str, list[str]] = {}

    def add(where: str, message: str) -> None:
        errors.setdefault(where, []).append(message)

    if time_zone not in available_timezones() and time_zone != "UTC":
        add("time_zone", f"unknown time zone {time_zone!r} (an IANA name such as Europe/Paris)")
    if not isinstance(rules, list):
        add("rules", "the rules must be a list")
        return errors
    if len(rules) > MAX_RULES:
        add("rules", f"at most {MAX_RULES} rules")
    facts = {"principal": "someone", "groups": [], "agent": "agent", "spend": "0"}
    names = activation(
        arguments=sample_arguments(tool_schema), facts=facts, tool="tool", time_zone="UTC"
    )
    known_fields = set(((tool_schema or {}).get("properties") or {}).keys())
    for index, rule in enumerate(rules, start=1):
        where = f"rule {index}"
        if not isinstance(rule, dict):
            add(where, "a rule must be an object")
            continue
        unknown = set(rule) - RULE_KEYS
        if unknown:
            add(where, f"unknown keys: {', '.join(sorted(unknown))}")
        decision = rule.get("decide")
        if decision not in DECISIONS:
            add(where, f"decide must be one of {', '.join(DECISIONS)}")
        when = rule.get("when", "")
        if not isinstance(when, str):
            add(where, "when must be a CEL expression (text)")
        elif len(when) > MAX_EXPRESSION:
            add(where, f"the expression is longer than {MAX_EXPRESSION} characters")
        elif when.strip():
            try:
                program = _program(when.strip())
            except Exception as exc:
                add(where, describe_error(exc))
            else:
                try:
                    result = program.evaluate(names)
                except Exception as exc:
                    message = describe_error(exc)
                    m = _NO_MEMBER.search(str(exc.args[0] if exc.args else exc))
                    if m and tool_schema is not None and m.group(1) not in known_fields:
                        message = (
                            f"args has no field {m.group(1)!r}; the tool's arguments are "
                            f"{', '.join(sorted(known_fields)) or '(none)'}"
                        )
                    add(where, message)
                else:
                    if not isinstance(result, celtypes.BoolType):
                        add(where, "the expression must be true or false")
        reason = rule.get("reason", "")
        if not isinstance(reason, str) or len(reason) > 500:
            add(where, "reason must be text of at most 500 characters")
        if decision == "require_approval":
            spec = rule.get("approval") or {}
            if not isinstance(spec, dict):
                add(where, "approval must be an object")
                continue
            unknown = set(spec) - APPROVAL_KEYS
            if unknown:
                add(where, f"unknown approval keys: {', '.join(sorted(unknown))}")
            group = spec.get("group") or "approver"
            if group not in groups:
                add(where, f"no group named {group!r}")
            required = spec.get("required", 1)
            if not isinstance(required, int) or isinstance(required, bool):
                add(where, "required must be a whole number")
            elif not 1 <= required <= MAX_REQUIRED:
                add(where, f"required must be between 1 and {MAX_REQUIRED}")
            ttl = spec.get("ttl_seconds", DEFAULT_TTL)
            if not isinstance(ttl, int) or isinstance(ttl, bool) or not MIN_TTL <= ttl <= MAX_TTL:
                add(where, f"ttl_seconds must be a whole number from {MIN_TTL} to {MAX_TTL}")
            on_expiry = spec.get("on_expiry", "reject")
            if on_expiry not in ON_EXPIRY:
                add(where, f"on_expiry must be one of {', '.join(ON_EXPIRY)}")
            escalate_to = spec.get("escalate_to") or ""
            if on_expiry == "escalate":
                if not escalate_to:
                    add(where, "on_expiry escalate needs escalate_to (a group)")
                elif escalate_to not in groups:
                    add(where, f"no group named {escalate_to!r}")
            from_groups = spec.get("from_groups", {})
            if not isinstance(from_groups, dict):
                add(where, 'from_groups must be an object: {"finance": 1}')
            else:
                for name, minimum in from_groups.items():
                    if name not in groups:
                        add(where, f"from_groups: no group named {name!r}")
                    if (
                        not isinstance(minimum, int)
                        or isinstance(minimum, bool)
                        or not 1 <= minimum <= MAX_REQUIRED
                    ):
                        add(
                            where,
                            f"from_groups: {name!r} needs a whole number from 1 to {MAX_REQUIRED}",
                        )
                total = sum(
                    n
                    for n in from_groups.values()
                    if isinstance(n, int) and not isinstance(n, bool)
                )
                if isinstance(required, int) and total > required:
                    add(
                        where,
                        f"from_groups asks for {total} approvers but required is {required}: "
                        "each approver counts for one group, so required must be at least "
                        "the sum of the minimums",
                    )
            if spec.get("bearer_links") and required != 1:
                add(
                    where,
                    "bearer_links (a link's token alone decides) is allowed for 1-of-1 "
                    "approvals only",
                )
        elif rule.get("approval"):
            add(where, "only a require_approval rule has approval settings")
    return errors

# size: the vocabulary agents and tools are written in (effects, policies, limits, the actions
# ``decide`` returns, ``Agent``, ``Tool``) imported from one place by every agent; mostly
# declarations and their docstrings, with little logic
"""Registry of hosted agents and tools (DESIGN §6).

Agents and tools are registered in code with a name and a version. The engine looks them up
by name when it claims a run; an unknown name is a clear error, never a crash loop.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import hashlib
import json
import logging
import time
import types
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from decimal import Decimal
from enum import StrEnum
from functools import cached_property
from typing import Any

import jsonschema

from runs.errors import DomainError


class Effect(StrEnum):
    READ = "read"  # no side effect: safe to call again
    IDEMPOTENT = "idempotent"  # the external system honours the idempotency key
    RECONCILABLE = "reconcilable"  # has a lookup by key
    UNSAFE = "unsafe"  # neither: an unknown outcome always goes to a person


class OnExpiry(StrEnum):
    REJECT = "reject"
    TERMINATE = "terminate"
    ESCALATE = "escalate"


@dataclass(frozen=True)
class ApprovalPolicy:
    """When a call needs a person's approval, and who may give it.

    ``when`` is "never", "always" or a predicate on the arguments.
    """

    when: str | Callable[[Mapping[str, Any]], bool] = "never"
    group: str = "approver"
    required: int = 1
    ttl_seconds: int = 24 * 3600
    on_expiry: OnExpiry = OnExpiry.REJECT
    escalate_to: str = ""
    allow_self_approval: bool = False
    # email links decide only for their recipient, signed in (DESIGN §9: N-of-M means N
    # distinct authenticated people). ``bearer_links``: the link's token alone decides, for
    # a 1-of-1 approval only — an explicit opt-in (a forwarded email then decides too).
    # ``require_login`` is kept for policies written before links needed a sign-in.
    require_login: bool = False
    bearer_links: bool = False
    # nobody who started, forked, signalled or resolved a run approves its calls
    separate_duties: bool = True

    def __post_init__(self) -> None:
        if self.bearer_links and self.required > 1:
            raise ValueError(
                "bearer_links (a link's token alone decides) is allowed for 1-of-1 approvals "
                f"only; this policy requires {self.required} approvers"
            )
        if self.bearer_links and self.require_login:
            raise ValueError("bearer_links and require_login contradict each other")

    @property
    def links_need_sign_in(self) -> bool:
        return not self.bearer_links

    def requires_approval(self, arguments: Mapping[str, Any]) -> bool:
        if self.when == "never":
            return False
        if self.when == "always":
            return True
        return bool(self.when(arguments))

    def describe(self) -> str:
        if isinstance(self.when, str):
            return self.when
        return getattr(self.when, "__doc__", None) or "conditional"


NO_APPROVAL = ApprovalPolicy()


# --- what a tool returns -------------------------------------------------------------------


@dataclass
class ToolResult:
    result: Any = None
    external_ref: str = ""


class ToolFailed(Exception):
    """The external system answered: the call definitely did not take effect."""


class OutcomeUnknown(Exception):
    """The call may or may not have taken effect: timeout, connection reset, 5xx."""


class LookupResult(StrEnum):
    FOUND = "found"
    ABSENT = "absent"
    UNKNOWN = "unknown"


@dataclass
class Reconciliation:
    outcome: LookupResult
    result: Any = None
    external_ref: str = ""
    detail: str = ""


class SendDeadlinePassed(OutcomeUnknown):
    """The request may no longer leave: this dispatch's send deadline (or its total time
    budget) has passed — the worker may have been paused, its lease taken over. Nothing was
    sent by this call of the tool; the outcome of the dispatch is reconciled as unknown."""


class Resend(StrEnum):
    AUTO = "auto"  # an absent lookup after the landing deadline re-sends with the same key
    PERSON = "person"  # an absent lookup goes to an operator instead (docs/agents.md)


@dataclass(frozen=True)
class Limits:
    """How much of a downstream a tool may use, across every worker (docs/agents.md,
    "Limits"): at most ``max_in_flight`` calls in flight (a slot is held from the
    ``dispatching`` commit until the call's receipt or its landing deadline, whichever comes
    first), and ``rate`` calls per ``per_seconds`` with a ``burst`` (default: 1). With
    ``key_argument``, each value of that argument has its own limit (a merchant account)."""

    max_in_flight: int | None = None
    rate: float | None = None
    per_seconds: float = 1.0
    burst: int | None = None
    key_argument: str = ""

    def __post_init__(self) -> None:
        if self.max_in_flight is not None and self.max_in_flight < 1:
            raise ValueError("max_in_flight must be at least 1")
        if self.rate is not None and self.rate <= 0:
            raise ValueError("rate must be positive")
        if self.per_seconds <= 0:
            raise ValueError("per_seconds must be positive")
        if self.burst is not None and self.burst < 1:
            raise ValueError("burst must be at least 1")

    @property
    def binding(self) -> bool:
        return self.max_in_flight is not None or self.rate is not None

    @property
    def interval(self) -> float:
        """Seconds between two calls at the rate (0 with no rate)."""
        return self.per_seconds / self.rate if self.rate else 0.0

    def key_of(self, arguments: Mapping[str, Any]) -> str:
        """The value of the key argument, as the limit's key ("" when not keyed)."""
        if not self.key_argument:
            return ""
        value = arguments.get(self.key_argument) if isinstance(arguments, Mapping) else None
        return "" if value is None else str(value)[:200]

    def describe(self) -> str:
        parts = []
        if self.max_in_flight is not None:
            parts.append(f"at most {self.max_in_flight} in flight")
        if self.rate is not None:
            per = {1.0: "second", 60.0: "minute"}.get(self.per_seconds, f"{self.per_seconds:g} s")
            parts.append(f"{self.rate:g} per {per} (burst {self.burst or 1})")
        if self.key_argument:
            parts.append(f"per {self.key_argument}")
        return ", ".join(parts) or "no limit"


@dataclass(frozen=True)
class ToolContext:
    """What a tool's ``call`` gets besides the arguments (DESIGN §9). The key, the fence and
    the send deadline travel with the request (``headers()``) so the downstream can check
    them; ``remaining()`` is the call's total time budget, connection set-up included
    (``runs.toolhttp`` enforces it for HTTP)."""

    run_id: str
    idempotency_key: str
    attempt: int
    timeout: float
    # the incarnation that dispatched the call (the run's fence)
    fence: int | None = None
    # database time: a downstream that honours deadlines refuses a request received later
    send_deadline: datetime | None = None
    # local monotonic clock: no byte of the request may be written after ``send_by``, and
    # the whole call ends by ``finish_by``; both started before the pre-send check's query
    send_by: float | None = None
    finish_by: float | None = None

    def remaining(self) -> float:
        """Seconds left of the call's total timeout (never negative)."""
        if self.finish_by is None:
            return self.timeout
        return max(0.0, self.finish_by - time.monotonic())

    def check_send(self) -> None:
        """Raise ``SendDeadlinePassed`` once the request may no longer leave. Call it as
        late as possible before the first byte is written (``runs.toolhttp`` does)."""
        now = time.monotonic()
        if self.send_by is not None and now >= self.send_by:
            raise SendDeadlinePassed(
                f"send deadline passed {now - self.send_by:.3f}s ago: the request was not sent"
            )
        if self.finish_by is not None and now >= self.finish_by:
            raise SendDeadlinePassed("the call's total timeout passed before the request was sent")

    def headers(self) -> dict[str, str]:
        """What the downstream can check, as HTTP headers: the idempotency key, the fence
        and the send deadline (RFC 3339, UTC)."""
        headers = {"Idempotency-Key": self.idempotency_key}
        if self.fence is not None:
            headers["X-Agentops-Fence"] = str(self.fence)
        if self.send_deadline is not None:
            headers["X-Agentops-Send-Deadline"] = self.send_deadline.astimezone(UTC).isoformat()
        return headers


@dataclass
class Tool:
    name: str
    effect: Effect
    call: Callable[[Mapping[str, Any], ToolContext], ToolResult]
    schema: Mapping[str, Any] = field(default_factory=lambda: {"type": "object"})
    description: str = ""
    sensitive_fields: tuple[str, ...] = ()
    # Paths into the tool's result whose values are sensitive (``runs.masking``): dotted
    # keys, ``*`` for every item of a list, e.g. ``("customer.email", "contacts.*.phone")``.
    # Masked wherever they are shown to people, including where the agent copied them.
    sensitive_output: tuple[str, ...] = ()
    approval: ApprovalPolicy = NO_APPROVAL
    allowed_groups: tuple[str, ...] = ()
    timeout: float = 10.0
    # lookup by idempotency key; raising is "don't know", never absence
    reconcile: Callable[[str, Mapping[str, Any]], Reconciliation] | None = None
    precondition: Callable[[Mapping[str, Any]], str] | None = None
    # The version the author declares (optional). The recorded version — ``version`` after
    # construction, ``ToolCall.tool_version`` — is a fingerprint of it and of everything the
    # tool does (``tool_fingerprint``): a changed behaviour is a changed tool.
    version: str = ""
    # What the downstream honours (DESIGN §9, docs/agents.md): ``honours_key`` — it
    # deduplicates by the idempotency key (default: the ``idempotent`` class);
    # ``honours_deadline`` — it refuses a request it receives after the send deadline it
    # carries (X-Agentops-Send-Deadline). With neither, a pause between the pre-send check
    # and the request's last byte can still duplicate an effect: ``resend="person"`` sends an
    # absent lookup to an operator instead of re-sending.
    honours_key: bool | None = None
    honours_deadline: bool = False
    resend: Resend = Resend.AUTO
    # Fingerprints of earlier versions declared compatible on purpose: a call recorded with
    # one of them is treated as a call of this tool (its approval stays valid), and the
    # engine records ``tool.version_accepted`` when it accepts one (docs/agents.md).
    compatible_with: tuple[str, ...] = ()
    # One line that tells a person what a call does ("Refund 2,500.00 EUR to order
    # ord_1004"), from its arguments with the sensitive fields masked (``call_summary``):
    # the approval email's subject and body, the approval page, the inbox and the timeline
    summary: Callable[[Mapping[str, Any]], str] | None = None
    # Arguments that are amounts of money in minor units, and their currency: an ISO 4217
    # code ("EUR"), or the name of another argument of the call that holds it. Shown to
    # people as "2,500.00 EUR" (``argument_rows``), never as ``250000``.
    money_arguments: Mapping[str, str] = field(default_factory=dict)
    # What a dry run calls instead of ``call`` (issue 23; docs/agents.md, "Dry runs"): it
    # gets the same arguments and context and returns what the call *would* do, touching
    # nothing outside. A ``read`` tool needs none (a dry run reads for real); an agent with a
    # tool that is not ``read`` and declares none cannot be started as a dry run.
    dry_run: Callable[[Mapping[str, Any], ToolContext], ToolResult] | None = None
    # How much of its downstream the tool may use across all workers (``Limits``); an
    # operator's limit (``runs.models.ToolLimit``) replaces it at run time
    limits: Limits | None = None
    # What one call may cost at most (money, tokens): reserved against the spend caps that
    # cover a run when the call is dispatched, charged when it succeeds (runs.spend,
    # docs/agents.md "Spend caps"); None: the call costs nothing a cap counts
    max_cost: Decimal | None = None
    max_tokens: int | None = None
    declared_version: str = field(init=False, default="")

    def __post_init__(self) -> None:
        if self.effect == Effect.RECONCILABLE and self.reconcile is None:
            raise ValueError(f"tool {self.name}: a reconcilable tool needs a reconcile lookup")
        if self.honours_key is None:
            self.honours_key = self.effect == Effect.IDEMPOTENT
        self.resend = Resend(self.resend)
        if self.timeout <= 0:
            raise ValueError(f"tool {self.name}: timeout must be positive")
        if self.max_cost is not None:
            self.max_cost = Decimal(str(self.max_cost))
            if self.max_cost < 0:
                raise ValueError(f"tool {self.name}: max_cost must not be negative")
        if self.max_tokens is not None and self.max_tokens < 0:
            raise ValueError(f"tool {self.name}: max_tokens must not be negative")
        jsonschema.Draft202012Validator.check_schema(self.schema)
        self.compatible_with = tuple(self.compatible_with)
        self.money_arguments = dict(self.money_arguments)
        self.sensitive_output = tuple(self.sensitive_output)
        for path in self.sensitive_output:
            if not path_is_valid(path):
                raise ValueError(f"tool {self.name}: invalid sensitive output path {path!r}")
        # computed once, from the tool as constructed: every process that imports the same
        # code computes the same fingerprint (workers recover each other's runs)
        self.declared_version = self.version
        self.version = tool_fingerprint(self)

    @property
    def simulates(self) -> bool:
        """Whether a dry run can call this tool: a ``read`` (called for real) or a tool that
        declares its ``dry_run``."""
        return self.effect == Effect.READ or self.dry_run is not None

    def accepts(self, version: str) -> bool:
        """Whether a call recorded with ``version`` is a call of this tool as it is now."""
        return version == self.version or version in self.compatible_with

    @cached_property
    def _validator(self) -> jsonschema.Draft202012Validator:
        # built once per tool, not at every call (the engine validates every decided call)
        return jsonschema.Draft202012Validator(self.schema)

    def validate(self, arguments: Any) -> list[str]:
        validator = self._validator
        if validator.is_valid(arguments):
            return []
        return [
            f"{'/'.join(str(p) for p in error.absolute_path) or '(root)'}: {error.message}"
            for error in sorted(validator.iter_errors(arguments), key=lambda e: list(e.path))
        ]

    def mask(self, arguments: Mapping[str, Any]) -> dict[str, Any]:
        return mask(arguments, self.sensitive_fields)


def mask(data: Mapping[str, Any], sensitive_fields: tuple[str, ...]) -> dict[str, Any]:
    return {key: ("***" if key in sensitive_fields else value) for key, value in data.items()}


def path_is_valid(path: Any) -> bool:
    """A sensitive output path: dot-separated non-empty segments (``*``: every list item)."""
    return (
        isinstance(path, str)
        and 0 < len(path) <= 200
        and all(segment for segment in path.split("."))
        and path.isprintable()
    )


SUMMARY_MAX = 140


def call_summary(tool_name: str, arguments_masked: Mapping[str, Any]) -> str:
    """The one-line description of a call for people: the tool's ``summary`` of its masked
    arguments, or the tool's name and its arguments. Never longer than ``SUMMARY_MAX``
    characters, never more than a line."""
    text = ""
    # local tools only: a remote agent's manifest declares no summary, and looking it up
    # would cost a query per row of a list
    found = registry.local_tool(tool_name)
    declared = found.summary if found is not None else None
    if declared is not None and isinstance(arguments_masked, Mapping):
        try:
            text = str(declared(arguments_masked))
        except Exception:
            # a summary is a courtesy: a bad one (a missing argument, an old call's shape)
            # falls back to the plain description, it never breaks a page or an email
            logging.getLogger(__name__).warning(
                "tool %s: its summary failed", tool_name, exc_info=True
            )
    if not text:
        shown = ", ".join(f"{key}={value}" for key, value in dict(arguments_masked or {}).items())
        text = f"{tool_name}({shown})"
    text = " ".join(text.split())
    return text if len(text) <= SUMMARY_MAX else text[: SUMMARY_MAX - 1] + "…"


def argument_rows(tool_name: str, arguments_shown: Any) -> list[tuple[str, str]]:
    """A call's arguments as (name, text) rows for people, from the arguments as the viewer
    may see them (masked values stay ``***``): money with its currency (the tool's
    ``money_arguments``), text as it is, anything nested as compact JSON."""
    if not isinstance(arguments_shown, Mapping):
        return [("", json.dumps(arguments_shown, default=str))]
    found = registry.local_tool(tool_name)
    moneys = found.money_arguments if found is not None else {}
    rows = []
    for name, value in arguments_shown.items():
        currency = moneys.get(name)
        if currency is not None and isinstance(value, int) and not isinstance(value, bool):
            code = arguments_shown.get(currency, currency)
            text = money(value, str(code))
        elif isinstance(value, str):
            text = value
        else:
            text = json.dumps(value, default=str, ensure_ascii=False)
        rows.append((str(name), text))
    return rows


def money(amount_minor: int, currency: str, *, exponent: int = 2) -> str:
    """An amount in minor units with its currency, as people read it: 250000, "EUR" →
    "2,500.00 EUR"."""
    sign = "-" if amount_minor < 0 else ""
    units, minor = divmod(abs(int(amount_minor)), 10**exponent)
    fraction = f".{minor:0{exponent}d}" if exponent else ""
    return f"{sign}{units:,}{fraction} {currency}"


def digest(data: Any) -> str:
    canonical = json.dumps(data, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(canonical.encode()).hexdigest()


# --- a tool's fingerprint (docs/agents.md, "Tool versions") ------------------------------------

# Tool fields that are not part of what the tool does: who may use it (checked at every
# dispatch anyway), how long a call may take, how it is described, and the fingerprint's own
# bookkeeping. Every other field — including ones added later — is part of the fingerprint.
NOT_IN_FINGERPRINT = frozenset(
    {
        "name",
        "description",
        "allowed_groups",
        "timeout",
        "version",
        "compatible_with",
        "declared_version",
        # what the downstream honours is configuration of how the engine treats an unknown
        # outcome (the demo's follows AGENTOPS_SANDBOX_HONOURS), not what the tool does: a
        # changed declaration must not retire every call in flight
        "honours_key",
        "honours_deadline",
        "resend",
        # masked when shown (runs.masking, from the current declaration), never at write
        # time: it changes what people see, not what the tool does or what was recorded, so
        # declaring it must not retire calls in flight or re-ask approvals. (Sensitive
        # *arguments* are different: they are masked when written, into what an approver
        # saw and approved, so they are part of the fingerprint.)
        "sensitive_output",
        # how a call is described to people, like ``description``
        "summary",
        # how much of the downstream the engine lets it use, not what it does: a changed
        # limit must not retire the calls in flight
        "limits",
        "money_arguments",
        # what a dry run calls instead of the tool: never part of a real call's effect, so
        # declaring or changing it must not retire real calls in flight or re-ask approvals
        "dry_run",
        # what a call may cost, for the spend caps (runs.spend): accounting, not behaviour
        "max_cost",
        "max_tokens",
    }
)
_FINGERPRINT_LENGTH = 16  # hex characters; ToolCall.tool_version holds up to 64


def tool_fingerprint(tool: Tool) -> str:
    """The recorded version of ``tool``: a digest of its declared version, schema, effect
    class, sensitive fields, approval policy (every field; a ``when`` predicate by its code),
    and the code of ``call``, ``reconcile`` and ``precondition`` (None when absent).

    Code counts by what it does, never by where it is: bytecode, constants, names, argument
    defaults and closure values — not line numbers, file names or function names, so moving
    a function leaves it unchanged; a docstring does not count either. The functions and
    classes of its own module that a function refers to count by their code, and so do
    module-level constants named in capitals. Nothing process-specific goes in (no ``id()``,
    no ``hash()``, no default ``repr``): a value that is neither plain data nor code counts
    by its type only, so every process that imports the same code computes the same value."""
    walk = _Walk()
    data = {
        f.name: walk.identity(getattr(tool, f.name))
        for f in dataclasses.fields(tool)
        if f.name not in NOT_IN_FINGERPRINT
    }
    data["schema"] = _json_value(tool.schema)
    data["declared_version"] = tool.declared_version
    return digest(data)[:_FINGERPRINT_LENGTH]


_MAX_DEPTH = 12  # functions within functions: far beyond any tool's helpers


class _Walk:
    """One fingerprint's walk over values and code. ``_active`` holds the ids of the
    callables being described (a recursive helper refers to itself): ids guard the walk,
    they never reach the description."""

    def __init__(self) -> None:
        self._active: set[int] = set()

    def identity(self, value: Any) -> Any:
        """A JSON-able description of ``value``, the same in every process: plain immutable
        values by value, code by its bytecode, anything else by its type."""
        declared = getattr(value, "__fingerprint__", None)
        if declared is not None and callable(value):
            # behaviour that lives elsewhere (a remote agent's tool): its identity is declared
            return ["declared", _json_value(declared)]
        if isinstance(value, enum.Enum):
            return ["enum", _type_name(type(value)), self.identity(value.value)]
        if value is None or isinstance(value, bool | int | str):
            return value
        if isinstance(value, float | complex | Decimal):
            return [type(value).__name__, repr(value)]
        if isinstance(value, bytes):
            return ["bytes", value.hex()]
        if value is Ellipsis:
            return ["..."]
        if isinstance(value, tuple):
            return ["tuple", [self.identity(item) for item in value]]
        if isinstance(value, frozenset):
            # sorted by their text: a frozenset's order follows str hashes, which differ
            # from process to process
            items = [self.identity(item) for item in value]
            return ["frozenset", sorted(items, key=lambda item: json.dumps(item, sort_keys=True))]
        if isinstance(value, types.CodeType):
            return self._code(value)
        if dataclasses.is_dataclass(value) and not isinstance(value, type) and _frozen(value):
            # an ApprovalPolicy: every field, a predicate by its code
            return [
                "dataclass",
                _type_name(type(value)),
                {f.name: self.identity(getattr(value, f.name)) for f in dataclasses.fields(value)},
            ]
        if callable(value):
            return self._callable(value)
        # mutable or opaque (a list, a dict, a client): what it holds now is state, not
        # behaviour, and may differ between processes
        return ["object", _type_name(type(value))]

    def _callable(self, fn: Any) -> Any:
        if id(fn) in self._active or len(self._active) >= _MAX_DEPTH:
            return ["recursive", getattr(fn, "__qualname__", _type_name(type(fn)))]
        self._active.add(id(fn))
        try:
            if isinstance(fn, functools.partial):
                return [
                    "partial",
                    self.identity(fn.func),
                    self.identity(tuple(fn.args)),
                    {key: self.identity(item) for key, item in sorted(fn.keywords.items())},
                ]
            if isinstance(fn, types.MethodType):
                return ["method", self.identity(fn.__func__), self._instance(fn.__self__)]
            if isinstance(fn, types.FunctionType):
                return self._function(fn)
            if isinstance(fn, type):
                return self._class(fn)
            if isinstance(
                fn,
                types.BuiltinFunctionType
                | types.MethodWrapperType
                | types.WrapperDescriptorType
                | types.MethodDescriptorType,
            ):
                return ["builtin", getattr(fn, "__module__", None), fn.__qualname__]
            return self._instance(fn)
        finally:
            self._active.discard(id(fn))

    def _function(self, fn: types.FunctionType) -> Any:
        code = fn.__code__
        module = fn.__globals__.get("__name__")
        referenced = {
            name: self.identity(fn.__globals__[name])
            for name in sorted(_names(code))
            if name in fn.__globals__ and _follows(name, fn.__globals__[name], module)
        }
        return {
            "code": self._code(code, docstring=fn.__doc__),
            "defaults": self.identity(tuple(fn.__defaults__ or ())),
            "kwdefaults": {
                key: self.identity(item) for key, item in sorted((fn.__kwdefaults__ or {}).items())
            },
            "closure": [self._cell(cell) for cell in fn.__closure__ or ()],
            "globals": referenced,
        }

    def _code(self, code: types.CodeType, docstring: str | None = None) -> Any:
        consts = [self.identity(const) for const in code.co_consts]
        if docstring is not None and consts and code.co_consts[0] == docstring:
            consts[0] = "<docstring>"  # kept in place: the bytecode names constants by index
        return {
            # co_code is the bytecode as compiled (not the interpreter's specialised copy);
            # line numbers live in co_linetable / co_firstlineno, which are left out
            "bytecode": code.co_code.hex(),
            "exceptions": getattr(code, "co_exceptiontable", b"").hex(),
            "consts": consts,
            "names": list(code.co_names),
            "varnames": list(code.co_varnames),
            "freevars": list(code.co_freevars),
            "cellvars": list(code.co_cellvars),
            "args": [code.co_argcount, code.co_posonlyargcount, code.co_kwonlyargcount],
            "flags": code.co_flags,
        }

    def _cell(self, cell: types.CellType) -> Any:
        try:
            contents = cell.cell_contents
        except ValueError:  # a closure variable not assigned yet
            return ["empty"]
        return self.identity(contents)

    def _instance(self, obj: Any) -> Any:
        """A callable object (or a bound method's object): its class's code and its own
        attributes (plain values by value, functions by code, anything else by type)."""
        if isinstance(obj, type):
            return self._class(obj)
        attributes = getattr(obj, "__dict__", {})
        return [
            "instance",
            self._class(type(obj)),
            {name: self.identity(item) for name, item in sorted(attributes.items())},
        ]

    def _class(self, cls: type) -> Any:
        if cls.__module__ == "builtins":
            return ["builtin", "builtins", cls.__qualname__]
        members = []
        for klass in cls.__mro__:
            if klass.__module__ == "builtins":
                continue
            for name, member in sorted(vars(klass).items()):
                if isinstance(member, staticmethod | classmethod):
                    member = member.__func__
                if isinstance(member, property):
                    member = (member.fget, member.fset, member.fdel)
                elif not isinstance(member, types.FunctionType) and (
                    name.startswith("__") or not _is_plain_data(member)
                ):
                    continue
                members.append([name, self.identity(member)])
        return ["class", members]


def _names(code: types.CodeType) -> set[str]:
    """The names a code object (and the functions and comprehensions inside it) refers to."""
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _names(const)
    return names


def _follows(name: str, value: Any, module: Any) -> bool:
    """Whether a module-level name a function uses is part of its behaviour: a function or
    class of the same module, or a constant (a plain value named in capitals)."""
    if isinstance(value, types.FunctionType | type):
        return getattr(value, "__module__", None) == module
    return name.isupper() and _is_plain_data(value)


def _is_plain_data(value: Any) -> bool:
    if value is None or isinstance(value, bool | int | float | str | bytes | Decimal | enum.Enum):
        return True
    if isinstance(value, tuple | frozenset):
        return all(_is_plain_data(item) for item in value)
    return False


def _json_value(value: Any) -> Any:
    return json.loads(json.dumps(value, sort_keys=True, default=str))


def _frozen(value: Any) -> bool:
    params = getattr(type(value), "__dataclass_params__", None)
    return bool(params is not None and params.frozen)


def _type_name(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


# --- what an agent decides ----------------------------------------------------------------


@dataclass(frozen=True)
class CallTool:
    tool: str
    arguments: Mapping[str, Any]
    # a remote agent's own id for the call (its framework's tool-call id): stored with it
    client_call_id: str = ""


@dataclass(frozen=True)
class Finish:
    result: Any = None


@dataclass(frozen=True)
class Fail:
    """The run ends ``failed`` with ``reason``. ``code`` is the run's reason code: the agent
    gave up (``agent_failed``, the default), or an approval it needed was rejected
    (``approval_rejected``) or expired (``approval_expired``) — so a refused refund reads
    as what it was, not as the agent's own failure."""

    reason: str
    code: str = "agent_failed"


# the reason codes an agent may end its run with (``Fail.code``)
AGENT_FAIL_CODES = ("agent_failed", "approval_rejected", "approval_expired")


def approval_refusal(step: StepView | None) -> str:
    """``approval_rejected`` or ``approval_expired`` when ``step`` is a tool call that failed
    because its approval was refused or ran out (the engine's error for it); else ""."""
    if step is None or step.status != "failed" or not step.error.startswith("approval rejected"):
        return ""
    return "approval_expired" if step.error.endswith("approval_expired") else "approval_rejected"


# --- waits (docs/waits.md): the run parks in ``waiting_event`` with no lease held --------------


@dataclass(frozen=True)
class WaitForSignal:
    """Wait for the signal ``name`` (``runs.waits.run_signal``). A signal sent before the
    wait began is delivered at once. The step's output is the signal's payload, or
    ``default`` when ``timeout_seconds`` pass first (None: wait for ever)."""

    name: str
    timeout_seconds: float | None = None
    default: Any = None


@dataclass(frozen=True)
class Sleep:
    """Wait until a time (timezone-aware ``until``) or for ``seconds``; exactly one."""

    until: datetime | None = None
    seconds: float | None = None


@dataclass(frozen=True)
class AskQuestion:
    """Ask people in ``group`` a question: free text, or one of ``choices``. The step's
    output is the answer, or ``default`` when nobody answered within ``ttl_seconds``."""

    text: str
    choices: Sequence[str] | None = None
    group: str = "operator"
    ttl_seconds: float = 24 * 3600
    default: Any = None


Wait = WaitForSignal | Sleep | AskQuestion
Action = CallTool | Finish | Fail | WaitForSignal | Sleep | AskQuestion


@dataclass(frozen=True)
class Usage:
    """What deciding cost (an LLM agent's tokens and money). Recorded on the decided step and
    added to the run's persisted usage in the ``decided`` commit, so budgets see it."""

    tokens: int = 0
    cost: Decimal = Decimal(0)
    detail: Mapping[str, Any] = field(default_factory=dict)
    # the model's answers that led to the action (an LLM agent's, masked; runs/llm.py):
    # recorded as ``answers`` in step.decided so ``manage.py replay`` can reuse them
    answers: tuple[Mapping[str, Any], ...] = ()


@dataclass(frozen=True)
class Decision:
    """An action together with what deciding it cost: ``decide`` may return this instead
    of a bare action."""

    action: Action
    usage: Usage


class DecisionPostponed(Exception):
    """``decide`` cannot answer now for a reason outside the agent (its model API is
    overloaded or down): the run is released and tried again after ``retry_after`` seconds,
    rather than failed."""

    def __init__(self, message: str, *, retry_after: float) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class ModelWithdrawn(Exception):
    """``decide`` cannot answer because the model the run is pinned to no longer exists (its
    provider withdrew it): asking again later would get the same answer, and failing the
    run would throw its work away, so it waits for a person (``model_unavailable``) who
    moves it to the configured model."""


@dataclass(frozen=True)
class StepView:
    seq: int
    kind: str
    status: str
    input: Mapping[str, Any]
    output: Any
    error: str


@dataclass(frozen=True)
class DecisionContext:
    run_id: str
    goal: str
    input: Mapping[str, Any]
    state: Mapping[str, Any]
    steps: tuple[StepView, ...]

    @property
    def last_step(self) -> StepView | None:
        return self.steps[-1] if self.steps else None


class Agent:
    """A hosted agent. ``decide`` sees the authoritative state and step history and returns
    one action; ``apply`` folds a finished step's outcome into the state."""

    name: str = ""
    version: str = "1"
    description: str = ""
    input_schema: Mapping[str, Any] = {"type": "object"}
    tools: tuple[str, ...] = ()
    # input fields people look runs up by (an order id, a customer): the runs list's search
    # box finds a run whose input has the searched text as one of these fields' values
    searchable_input: tuple[str, ...] = ()
    # State migrations, ``(from_version, to_version, migrate)``: a run started on an older
    # version is upgraded hop by hop when it is claimed (DESIGN §5.2). With no path from the
    # run's version to this one the run waits for a person (fork or terminate).
    migrations: Sequence[tuple[str, str, Callable[[dict[str, Any]], dict[str, Any]]]] = ()

    def migration_path(
        self, from_version: str
    ) -> list[tuple[str, str, Callable[[dict[str, Any]], dict[str, Any]]]] | None:
        """The hops from ``from_version`` to this version, in order; None when there is none."""
        by_source = {source: (source, target, fn) for source, target, fn in self.migrations}
        path = []
        version = from_version
        while version != self.version:
            hop = by_source.get(version)
            if hop is None or len(path) > len(by_source):  # no edge, or a cycle
                return None
            path.append(hop)
            version = hop[1]
        return path

    def initial_state(self, input: Mapping[str, Any]) -> dict[str, Any]:
        return {}

    def model_for_new_run(self) -> str:
        """The model a new run of this agent is pinned to (``Run.model_id``); empty for
        agents that use no model. A run keeps its model for life (runs/llm.py)."""
        return ""

    def decide(self, ctx: DecisionContext) -> Action:
        raise NotImplementedError

    def decision_maximum(self, run: Any) -> Usage | None:
        """The most one decision of ``run`` may cost (an agent that asks a model: its
        requests' declared maximum), reserved before ``decide`` is called and settled at the
        ``Usage`` it returns (runs.spend: a request a crash cuts off still counts). None (the
        default): deciding costs nothing; nothing is reserved."""
        return None

    def apply(self, state: dict[str, Any], step: StepView) -> dict[str, Any]:
        return state

    def tools_without_dry_run(self) -> list[str]:
        """This agent's tools that are not ``read`` and declare no ``dry_run``: a dry run of
        it is refused while there is one (``runs.services.run_create``)."""
        missing = []
        for name in self.tools:
            try:
                tool = registry.tool(name)
            except UnknownTool:
                missing.append(name)
                continue
            if not tool.simulates:
                missing.append(name)
        return missing

    def sensitive_outputs(self) -> dict[str, tuple[str, ...]]:
        """Tool name -> the sensitive output paths it declares, for this agent's tools that
        declare any (``runs.masking``)."""
        found = {}
        for name in self.tools:
            try:
                paths = registry.tool(name).sensitive_output
            except UnknownTool:
                continue
            if paths:
                found[name] = paths
        return found


class UnknownAgent(DomainError, LookupError):
    code = "unknown_agent"
    status = 400


class UnknownTool(DomainError, LookupError):
    code = "unknown_agent"  # the API's code for a name the registry does not know
    status = 400


class Registry:
    def __init__(self) -> None:
        self._agents: dict[str, Agent] = {}
        self._tools: dict[str, Tool] = {}
        # remote agents live in the database (``runs.remote``), not in code: looked up there
        # when a name is not a hosted one, so every process sees the same manifest version
        self._remote_agent: Callable[[str], Agent | None] | None = None
        self._remote_tool: Callable[[str], Tool | None] | None = None

    def set_remote_resolvers(
        self,
        *,
        agent: Callable[[str], Agent | None],
        tool: Callable[[str], Tool | None],
    ) -> None:
        self._remote_agent = agent
        self._remote_tool = tool

    def register_tool(self, tool: Tool) -> Tool:
        self._tools[tool.name] = tool
        return tool

    def register_agent(self, agent: Agent) -> Agent:
        if not agent.name:
            raise ValueError("an agent needs a name")
        jsonschema.Draft202012Validator.check_schema(agent.input_schema)
        missing = [name for name in agent.tools if name not in self._tools]
        if missing:
            raise ValueError(f"agent {agent.name} uses unregistered tools: {', '.join(missing)}")
        self._agents[agent.name] = agent
        return agent

    def unregister_agent(self, name: str) -> None:
        self._agents.pop(name, None)

    def unregister_tool(self, name: str) -> None:
        self._tools.pop(name, None)

    def agent(self, name: str) -> Agent:
        found = self._agents.get(name)
        if found is None and self._remote_agent is not None:
            found = self._remote_agent(name)
        if found is None:
            raise UnknownAgent(f"unknown agent {name!r}")
        return found

    def local_tool(self, name: str) -> Tool | None:
        """A tool registered in this process (no remote manifest is consulted)."""
        return self._tools.get(name)

    def tool(self, name: str) -> Tool:
        found = self._tools.get(name)
        if found is None and self._remote_tool is not None:
            found = self._remote_tool(name)
        if found is None:
            raise UnknownTool(f"unknown tool {name!r}")
        return found

    def agents(self) -> list[Agent]:
        return sorted(self._agents.values(), key=lambda a: a.name)

    def tools(self) -> list[Tool]:
        return sorted(self._tools.values(), key=lambda t: t.name)

    def serves(self) -> dict[str, Any]:
        """What a worker with this registry can drive, recorded on its ``Worker`` row so that
        during a rolling deploy a worker hands a run it cannot serve to one that can: each
        hosted agent's version and every version a migration path leads from, each tool's
        fingerprint and the ones it declares ``compatible_with``."""
        agents: dict[str, list[str]] = {}
        for agent in self.agents():
            versions = {agent.version} | {source for source, _target, _fn in agent.migrations}
            agents[agent.name] = sorted(
                v for v in versions if v == agent.version or agent.migration_path(v) is not None
            )
        tools = {t.name: sorted({t.version, *t.compatible_with}) for t in self.tools()}
        return {"agents": agents, "tools": tools}

    def unguarded_tools(self) -> list[Tool]:
        """Registered tools whose unknown outcome is re-sent by themselves after an absent
        lookup, to a downstream that honours neither the key nor the send deadline: for
        them a worker frozen between its pre-send check and its request's last byte can
        still duplicate the effect (docs/agents.md, "What the downstream honours")."""
        return [
            tool
            for tool in self.tools()
            if tool.effect == Effect.RECONCILABLE
            and not tool.honours_key
            and not tool.honours_deadline
            and tool.resend == Resend.AUTO
        ]

    def warn_unguarded(self, log: Any) -> None:
        """One warning per such tool (runworker, at start)."""
        for tool in self.unguarded_tools():
            log.warning(
                "tool %s is reconcilable but its downstream honours neither the idempotency "
                "key nor the send deadline: a worker frozen right before its request leaves "
                "can still duplicate the effect; declare honours_key / honours_deadline, or "
                'resend="person" (docs/agents.md)',
                tool.name,
            )


registry = Registry()

"""One rule for JSON that comes in (issue 18): how deep, how large, how long a string, and no
NUL characters — the same on SQLite and PostgreSQL (which cannot store U+0000 in jsonb).

Every entrance uses it: the API's parser (``runs.api_parsers.LimitedJSONParser``), the
console's and the approval pages' JSON fields, the management commands, and — with
``sanitize`` instead of refusing — what a tool or a lookup returns, because that answer
records a real effect that must not be lost over a bad value.

The walk is iterative: a value nested 100,000 levels deep costs a loop, never a
``RecursionError``.
"""

from __future__ import annotations

import json
from typing import Any

from django.conf import settings

NUL = "\x00"


class JsonRejected(ValueError):
    """Input that breaks the rule; ``code`` is the API's machine-readable code."""

    def __init__(self, code: str, detail: str) -> None:
        super().__init__(detail)
        self.code = code
        self.detail = detail


def limits() -> tuple[int, int, int]:
    conf = settings.AGENTOPS
    return conf["JSON_MAX_DEPTH"], conf["JSON_MAX_BYTES"], conf["JSON_MAX_STRING"]


def loads(text: str | bytes) -> Any:
    """``json.loads`` under the rule: ``JsonRejected`` for input over a limit or with a NUL,
    ``ValueError`` (``json.JSONDecodeError``) for input that is not JSON."""
    _depth, max_bytes, _string = limits()
    size = len(text.encode() if isinstance(text, str) else text)
    if size > max_bytes:
        raise JsonRejected("json_too_large", f"the JSON is {size} bytes; at most {max_bytes}")
    try:
        value = json.loads(text)
    except RecursionError:
        raise JsonRejected("json_too_deep", _too_deep()) from None
    check(value)
    return value


def _too_deep() -> str:
    return f"the JSON is nested more than {limits()[0]} levels deep"


def _walk(value: Any):
    """(depth, item) for every value inside ``value``, keys included (as depth of their
    object + 1), without recursion."""
    stack = [(1, value)]
    while stack:
        depth, item = stack.pop()
        yield depth, item
        if isinstance(item, dict):
            for key, child in item.items():
                yield depth + 1, key
                stack.append((depth + 1, child))
        elif isinstance(item, list | tuple):
            stack.extend((depth + 1, child) for child in item)


def problem(value: Any) -> JsonRejected | None:
    """What breaks the rule in an already parsed value, or None."""
    max_depth, _bytes, max_string = limits()
    for depth, item in _walk(value):
        if depth > max_depth and isinstance(item, dict | list | tuple):
            return JsonRejected("json_too_deep", _too_deep())
        if isinstance(item, str):
            if NUL in item:
                return JsonRejected("nul_byte", "NUL characters (\\u0000) are not allowed")
            if len(item) > max_string:
                return JsonRejected(
                    "json_too_large",
                    f"a string of {len(item)} characters; at most {max_string}",
                )
    return None


def check(value: Any) -> None:
    found = problem(value)
    if found is not None:
        raise found


def sanitize(value: Any) -> tuple[Any, list[str]]:
    """``value`` made storable under the rule, with what was changed: NUL characters
    replaced by U+FFFD, strings over the limit shortened (marked), containers nested too
    deep replaced by a marker. For answers that record a real effect (tool results, lookup
    results): those are kept, never refused."""
    if problem(value) is None:
        return value, []
    max_depth, _bytes, max_string = limits()
    notes: set[str] = set()

    def fix_str(text: str) -> str:
        if NUL in text:
            notes.add("NUL characters replaced by U+FFFD")
            text = text.replace(NUL, "\ufffd")
        if len(text) > max_string:
            notes.add(f"strings longer than {max_string} characters shortened")
            text = text[:max_string] + f"…[{len(text) - max_string} characters removed]"
        return text

    def copy(item: Any, depth: int) -> Any:
        # the caller's loop: at most max_depth levels of this call
        if isinstance(item, dict | list | tuple) and depth > max_depth:
            notes.add(f"values nested deeper than {max_depth} levels removed")
            return f"[removed: nested deeper than {max_depth} levels]"
        if isinstance(item, dict):
            return {fix_str(str(k)): copy(v, depth + 1) for k, v in item.items()}
        if isinstance(item, list | tuple):
            return [copy(v, depth + 1) for v in item]
        if isinstance(item, str):
            return fix_str(item)
        return item

    return copy(value, 1), sorted(notes)


def pretty(value: Any, **kwargs: Any) -> str:
    """``json.dumps(value, indent=2, sort_keys=True)`` for a page, an email or an export,
    which never fails on stored data: JSON stored before the rule existed may be nested
    hundreds of levels deep, beyond what the indenting encoder's recursion can walk. Such a
    value is shown compactly, or as a note when even that is too deep."""
    try:
        return json.dumps(value, indent=2, sort_keys=True, default=str, **kwargs)
    except RecursionError:
        pass
    try:
        return json.dumps(value, sort_keys=True, default=str, **kwargs)
    except RecursionError:
        deepest = max(depth for depth, _item in _walk(value))
        return f'"[not shown: nested {deepest} levels deep]"'

"""Issue 22: every event type comes from one catalogue (``runs.record.eventtypes``)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from runs.record.checkpoint import Checkpoint
from runs.record.eventtypes import KNOWN, EventType, markdown_table

ROOT = Path(__file__).resolve().parent.parent
CODE = [
    path
    for package in ("runs", "approvals", "agentops")
    for path in (ROOT / package).rglob("*.py")
    if "migrations" not in path.parts and "client" not in path.parts
]
EVENT_LIKE = re.compile(r"[a-z]+\.[a-z_]+")


def _written_literals() -> dict[str, str]:
    """String literals given as an event's type: ``*.event("x.y", ...)``."""
    found = {}
    for path in CODE:
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr == "event"
                and node.args
                and isinstance(node.args[0], ast.Constant)
                and isinstance(node.args[0].value, str)
            ):
                found[node.args[0].value] = f"{path.relative_to(ROOT)}:{node.lineno}"
    return found


def test_the_code_writes_no_event_type_the_catalogue_does_not_list():
    unknown = {t: where for t, where in _written_literals().items() if t not in KNOWN}
    assert unknown == {}


def test_a_checkpoint_refuses_an_event_type_the_catalogue_does_not_list():
    cp = Checkpoint.__new__(Checkpoint)
    with pytest.raises(ValueError, match="unknown event type 'run.exploded'"):
        Checkpoint.event(cp, "run.exploded")


def test_every_catalogued_type_is_a_dotted_name_with_a_description():
    for value, label in EventType.choices:
        assert EVENT_LIKE.fullmatch(value), value
        assert label and label != value, value


def test_the_docs_list_is_the_catalogue():
    text = (ROOT / "docs" / "audit.md").read_text()
    block = text.split("<!-- event-types:start -->\n", 1)[1].split("\n<!-- event-types:end -->")[0]
    assert block == markdown_table(), "regenerate it: python manage.py event_types"


def _documented_codes() -> dict[str, int]:
    """docs/api.md's error table: ``| status | `code`, `code` | when |``."""
    text = (ROOT / "docs" / "api.md").read_text()
    table = text.split("## Errors", 1)[1].split("\n## ", 1)[0]
    found = {}
    for line in table.splitlines():
        match = re.match(r"\| (\d{3}) \| (.+?) \|", line)
        if match:
            for code in re.findall(r"`([a-z_]+)`", match.group(2)):
                found[code] = int(match.group(1))
    return found


def test_every_error_code_is_documented_with_its_status():
    import agentops.mcp.services  # noqa: F401  (its errors register their codes)
    import approvals.services  # noqa: F401
    import runs.api.common  # noqa: F401  (the API's own codes)
    import runs.api.longpoll  # noqa: F401
    import runs.remote.toolcalls  # noqa: F401
    from runs.errors import CODES

    assert _documented_codes() == CODES


def test_every_domain_error_has_one_base():
    """Each error class a service raises with a ``code`` is a ``runs.errors.DomainError``."""
    from runs.errors import DomainError

    strays = []
    for path in CODE:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef) and any(
                isinstance(item, ast.Assign)
                and any(getattr(t, "id", "") == "code" for t in item.targets)
                for item in node.body
            ):
                strays.append((path.relative_to(ROOT), node.name))
    import importlib

    for path, name in strays:
        if path.parts[0] == "agentops" and path.parts[1] == "demo":
            continue  # the sandbox is a downstream of its own
        module = importlib.import_module(".".join(path.with_suffix("").parts))
        cls = getattr(module, name)
        if issubclass(cls, Exception) and name != "JsonRejected":  # the JSON rule's own
            assert issubclass(cls, DomainError), f"{path}: {name}"


# fields whose value is one of a fixed set: each has choices (a nested TextChoices, or a
# catalogue's); free text (names, keys, hashes, actors, groups) is not status-like
STATUS_LIKE = re.compile(
    r"(^|_)(status|reason_code|channel|on_expiry|effect|kind|health|outcome|source|decision|requested_action)$"
)
# (model, field): why it has no choices
OPEN_SETS = {
    ("runs.OutboxMessage", "kind"): "kinds are registered by apps (runs.outbox.register_kind)",
}


def test_every_status_like_field_has_choices():
    """Issue 22: every status, reason, channel and action string of a model comes from one
    catalogue (its ``TextChoices``), so forms, the admin's filters and the docs list the
    same values."""
    from django.apps import apps

    bare = []
    models = [*apps.get_app_config("runs").get_models()]
    models += apps.get_app_config("approvals").get_models()
    for model in models:
        for model_field in model._meta.concrete_fields:
            label = (model._meta.label, model_field.name)
            if (
                model_field.get_internal_type() == "CharField"
                and STATUS_LIKE.search(model_field.name)
                and not model_field.choices
                and label not in OPEN_SETS
            ):
                bare.append(label)
    assert bare == []


def test_an_approvals_on_expiry_choices_are_the_registrys():
    from approvals.models import Approval
    from runs.registry import OnExpiry

    assert set(Approval.OnExpiry.values) == {action.value for action in OnExpiry}

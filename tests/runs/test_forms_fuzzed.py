"""Every console form and emailed-link page, posted generated input (Hypothesis): the answer
is a 2xx, 3xx or 4xx — never a server error — a refused form is shown again with its error,
and a refused request writes nothing (no partial write). Written against the URLs, so it
holds whichever module serves a page (runs.views, approvals.views, the link pages)."""

from __future__ import annotations

import json
import os
import re
from typing import Any

import pytest
from django.apps import apps
from django.contrib.auth.models import Group
from django.core import mail
from django.db import transaction
from django.test import Client
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from runs.models import Run, ToolCall
from runs.registry import (
    ApprovalPolicy,
    AskQuestion,
    CallTool,
    Effect,
    Finish,
    OutcomeUnknown,
)
from runs.services import run_create
from tests.conftest import drive
from tests.runs.wait_support import waits_then_finishes
from tests.support import CountingTool, ScriptedAgent, make_tool

pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("roles")]

# per form; `make fuzz` sets more (README)
EXAMPLES = int(os.environ.get("AGENTOPS_FUZZ_FORM_EXAMPLES", "40"))
EMAIL = "fuzzer@example.com"
PAY_SCHEMA = {
    "type": "object",
    "properties": {"amount_cents": {"type": "integer", "minimum": 1}},
    "required": ["amount_cents"],
    "additionalProperties": False,
}

# what people type, paste or a script sends: blanks, NUL, numbers out of range, dates that
# are not, JSON too deep or not an object, text over every limit, the choices themselves
SAMPLES = [
    "",
    " ",
    "\x00",
    "a\x00b",
    "0",
    "-1",
    "1.5",
    "1e309",
    "NaN",
    "9" * 40,
    "yes",
    "on",
    "true",
    "null",
    "{}",
    "[]",
    '{"order_id": "ord_1001", "amount_cents": 5}',
    '{"a": "\\u0000"}',
    "[" * 2000 + "]" * 2000,
    '{"a":' * 40 + "1" + "}" * 40,
    "2026-13-40 99:99",
    "2999-01-01 00:00",
    "approve",
    "reject",
    "happened",
    "not_happened",
    "terminate",
    "retry",
    "refund",
    "x" * 2001,
    "x" * 70_000,
    "<script>alert(1)</script>",
    "../../etc/passwd",
    "\ud7ff\ue000\U0010ffff",
]
VALUES = st.one_of(
    st.sampled_from(SAMPLES),
    st.text(max_size=30),
    st.integers(min_value=-(10**20), max_value=10**20).map(str),
)


def fields(*names: str) -> st.SearchStrategy[dict[str, Any]]:
    """Any subset of the form's fields, each one value or several (a repeated key)."""
    return st.fixed_dictionaries(
        {},
        optional={
            name: st.one_of(VALUES, st.lists(VALUES, min_size=2, max_size=3)) for name in names
        },
    )


def _link_token(pattern: str) -> str:
    for message in reversed(mail.outbox):
        if EMAIL in message.to:
            found = re.search(pattern, message.body)
            if found:
                return found.group(1)
    raise AssertionError(f"no email to {EMAIL} with a link {pattern}")


@pytest.fixture
def world(register, system_actor, django_user_model, django_capture_on_commit_callbacks):
    """Something to act on for every form: a run waiting on a question, a run waiting for an
    approval, a run whose call's outcome is unknown; one person in every role, with email."""

    def lost(arguments, ctx):
        raise OutcomeUnknown("connection reset by peer")

    def calls(tool: str):
        def decide(ctx):
            if not ctx.steps:
                return CallTool(tool, {"amount_cents": 500})
            return Finish({"status": ctx.last_step.status})

        return decide

    register(
        make_tool("fuzz_send", CountingTool(lost), effect=Effect.UNSAFE),
        make_tool(
            "fuzz_pay",
            CountingTool(),
            effect=Effect.IDEMPOTENT,
            schema=PAY_SCHEMA,
            approval=ApprovalPolicy(when="always", group="approver"),
        ),
        ScriptedAgent("fuzz_sender", calls("fuzz_send"), tools=("fuzz_send",)),
        ScriptedAgent("fuzz_payer", calls("fuzz_pay"), tools=("fuzz_pay",)),
        waits_then_finishes("fuzz_asks", AskQuestion(text="Which plan?", ttl_seconds=600)),
    )
    person = django_user_model.objects.create_superuser("fuzzer", EMAIL, "x")
    person.groups.add(*Group.objects.all())
    with django_capture_on_commit_callbacks(execute=True):
        asking = drive(run_create(agent_name="fuzz_asks", actor=system_actor).id)
        approving = drive(run_create(agent_name="fuzz_payer", actor=system_actor).id)
        unknown = drive(run_create(agent_name="fuzz_sender", actor=system_actor).id)
    assert asking.status == Run.Status.WAITING_EVENT
    assert approving.status == Run.Status.WAITING_APPROVAL
    call = ToolCall.objects.get(run=unknown)
    client = Client()
    client.force_login(person)
    return {
        "client": client,
        "run": str(asking.id),
        "approval": approving.approvals.get().id,
        "question": asking.questions.get().id,
        "call": call.id,
        "approval_token": _link_token(r"/approvals/link/([A-Za-z0-9_-]+)/"),
        "question_token": _link_token(r"/questions/link/([A-Za-z0-9_-]+)/"),
    }


# (what, URL, method, fields): every form of the console and of the emailed links
FORMS = [
    ("start", "/runs/start/", "post", ("agent", "goal", "input", "max_steps")),
    ("bulk", "/runs/bulk/", "post", ("action", "reason", "next", "run")),
    ("list filter", "/runs/", "get", ("status", "agent", "q", "sort", "after", "before")),
    ("pause", "/runs/{run}/pause/", "post", ("reason",)),
    ("resume", "/runs/{run}/resume/", "post", ()),
    ("terminate", "/runs/{run}/terminate/", "post", ("reason", "confirm")),
    ("budget", "/runs/{run}/budget/", "post", ("add_steps", "add_cost", "add_tokens", "deadline")),
    ("retry", "/runs/{run}/retry-recovery/", "post", ()),
    ("fork", "/runs/{run}/fork/", "post", ("from_step", "agent_version")),
    (
        "resolve",
        "/tool-calls/{call}/resolve/",
        "post",
        ("outcome", "external_ref", "result", "confirm_risk"),
    ),
    (
        "spend caps",
        "/spend/",
        "post",
        (
            "action",
            "scope",
            "subject",
            "max_cost",
            "max_tokens",
            "add_cost",
            "add_tokens",
            "reservation",
            "cost",
            "tokens",
        ),
    ),  # fmt: skip
    ("answer", "/questions/{question}/", "post", ("answer",)),
    ("question link", "/questions/link/{question_token}/", "post", ("answer",)),
    ("decide", "/approvals/{approval}/decide/", "post", ("action", "comment", "arguments")),
    (
        "approval link",
        "/approvals/link/{approval_token}/",
        "post",
        ("decision", "comment", "confirm"),
    ),
]


def _rows() -> dict[str, list[tuple]]:
    """Every row the runs and approvals apps hold: what a refused request must leave alone."""
    return {
        model._meta.label: list(model.objects.order_by("pk").values_list())
        for app in ("runs", "approvals")
        for model in apps.get_app_config(app).get_models()
    }


@pytest.mark.parametrize(("what", "url", "method", "names"), FORMS, ids=[f[0] for f in FORMS])
def test_no_form_answers_generated_input_with_a_server_error(world, what, url, method, names):
    client = world["client"]
    path = url.format(**world)
    # the page itself, before anything is posted to it
    assert client.get(path).status_code < 500

    @given(data=fields(*names), htmx=st.booleans())
    @settings(
        max_examples=EXAMPLES,
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
    )
    def posted(data, htmx):
        extra = {"HTTP_HX_REQUEST": "true"} if htmx else {}
        with transaction.atomic():
            before = _rows()
            if method == "get":
                response = client.get(path, data, **extra)
            else:
                response = client.post(path, data, **extra)
            status = response.status_code
            assert status < 500, (what, data, status)
            if status >= 400:
                assert _rows() == before, f"{what}: refused ({status}) after a write: {data!r}"
            if status == 400 and response["Content-Type"].startswith("text/html"):
                # the form again (or, for HTMX, the part of the page that says it) with
                # what was wrong
                assert b'role="alert"' in response.content or b"errorlist" in response.content, (
                    what,
                    data,
                )
            # each example starts from the same state
            transaction.set_rollback(True)

    posted()


def test_the_generated_values_include_what_the_json_rule_refuses():
    # the samples exercise the JSON rule's limits (runs.jsonlimits): deeper than 32 levels,
    # and a NUL inside a JSON string
    assert any(len(value) > 64 and value.startswith("[" * 64) for value in SAMPLES)
    assert any(
        json.loads(value) == {"a": "\x00"} for value in SAMPLES if value.startswith('{"a": "')
    )

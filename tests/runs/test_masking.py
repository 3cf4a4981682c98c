"""Masking by origin (runs.masking): a value a read tool declared sensitive in its result is
masked wherever the run is shown — also where the agent copied it — for everyone but people
with ``runs.view_sensitive``, while the engine and the agent keep the real value."""

from __future__ import annotations

import io
import json

import pytest
from django.contrib.auth.models import Permission
from django.core import mail
from django.core.management import call_command
from django.urls import reverse

from approvals.models import Approval
from runs.actors import Actor
from runs.masking import MASK, Masker, mask_paths, masker_for, sensitive_values, values_at
from runs.models import Question, Run, RunEvent, ToolCall, WebhookDelivery
from runs.registry import (
    ApprovalPolicy,
    AskQuestion,
    CallTool,
    Effect,
    Finish,
    OutcomeUnknown,
    ToolResult,
    UnknownTool,
)
from runs.services import run_create
from runs.tokens import api_token_create
from tests.conftest import drive
from tests.support import CountingTool, ScriptedAgent, make_tool

pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("roles")]

EMAIL = "carol@example.com"
PHONE = "555-0100"
CRM_ANSWER = {
    "customer": {"email": EMAIL, "name": "Carol"},
    "phones": [{"number": PHONE}, {"number": "555-0199"}],
    "order": 7,
}


# --- paths and the masker -------------------------------------------------------------------


def test_values_at_follows_keys_and_list_items():
    assert list(values_at(CRM_ANSWER, "customer.email")) == [EMAIL]
    assert list(values_at(CRM_ANSWER, "phones.*.number")) == [PHONE, "555-0199"]
    assert list(values_at(CRM_ANSWER, "customer.missing")) == []
    assert list(values_at(CRM_ANSWER, "order.deeper")) == []


def test_mask_paths_masks_the_whole_subtree_and_leaves_the_rest():
    masked = mask_paths(CRM_ANSWER, ["customer", "phones.*.number"])
    assert masked == {
        "customer": MASK,
        "phones": [{"number": MASK}, {"number": MASK}],
        "order": 7,
    }
    assert CRM_ANSWER["customer"]["email"] == EMAIL  # a copy: the record is untouched


def test_sensitive_values_are_the_leaves_at_the_paths_without_null_booleans_or_empty():
    answer = {"customer": {"email": EMAIL, "vip": True, "note": "", "id": 4242, "x": None}}
    assert sensitive_values(answer, ["customer"]) == {EMAIL, 4242}


def test_masker_masks_long_values_inside_text_and_short_ones_whole():
    mask = Masker(frozenset({EMAIL, "ab", 4242}))
    assert mask(
        {
            "note": f"write to {EMAIL} today",
            EMAIL: {"code": "ab", "other": "abc", "n": 4242, "m": 4243, "ok": True},
            "list": [EMAIL, 1],
        }
    ) == {
        "note": f"write to {MASK} today",
        MASK: {"code": MASK, "other": "abc", "n": MASK, "m": 4243, "ok": True},
        "list": [MASK, 1],
    }


def test_an_invalid_path_is_refused_when_the_tool_is_declared():
    with pytest.raises(ValueError, match="sensitive output path"):
        make_tool_with_output(("customer..email",))


def make_tool_with_output(paths):
    from runs.registry import Tool

    return Tool(
        name="crm_invalid",
        effect=Effect.READ,
        call=CountingTool(),
        sensitive_output=paths,
    )


def test_sensitive_output_is_not_part_of_the_fingerprint():
    from runs.registry import Tool

    plain = Tool(name="crm_fp", effect=Effect.READ, call=CountingTool())
    declared = Tool(
        name="crm_fp", effect=Effect.READ, call=CountingTool(), sensitive_output=("a.b",)
    )
    assert plain.version == declared.version


# --- a run that copies a sensitive value everywhere -------------------------------------------


@pytest.fixture
def crm(register):
    """``crm_lookup`` (read) answers CRM_ANSWER with the email and phones declared sensitive;
    the agent copies the email into its state, into a non-sensitive argument of ``crm_note``
    and into its result: every copy must be masked, and ``crm_note`` gets the real value."""
    lookup_body = CountingTool(lambda arguments, ctx: ToolResult(result=CRM_ANSWER))
    note_body = CountingTool()

    def decide(ctx):
        if not ctx.steps:
            return CallTool("crm_lookup", {"customer_id": "c1"})
        if len(ctx.steps) == 1:
            email = ctx.state["email"]
            return CallTool("crm_note", {"body": f"Write to {email} about the order"})
        return Finish({"contacted": ctx.state["email"]})

    class Agent(ScriptedAgent):
        def apply(self, state, step):
            if step.input.get("tool") == "crm_lookup" and step.status == "completed":
                state["email"] = step.output["customer"]["email"]
            return state

    lookup = make_tool("crm_lookup", lookup_body)
    lookup.sensitive_output = ("customer.email", "phones.*.number")
    note = make_tool("crm_note", note_body)
    register(lookup, note, Agent("crm_agent", decide, tools=("crm_lookup", "crm_note")))
    return note_body


@pytest.fixture
def finished_run(crm, system_actor) -> Run:
    run = run_create(agent_name="crm_agent", input={}, actor=system_actor)
    run = drive(run.id)
    assert run.status == Run.Status.SUCCEEDED, run.reason_detail
    return run


def _auditor(django_user_model, username: str):
    from django.contrib.auth.models import Group

    # staff: auditors read the admin site
    user = django_user_model.objects.create_user(username=username, is_staff=True)
    user.groups.add(Group.objects.get(name="auditor"))
    return user


@pytest.fixture
def auditor_who_may_see(django_user_model):
    user = _auditor(django_user_model, "aude")
    user.user_permissions.add(
        Permission.objects.get(content_type__app_label="runs", codename="view_sensitive")
    )
    return user


@pytest.fixture
def plain_auditor(django_user_model):
    return _auditor(django_user_model, "audrey")


def test_the_engine_and_the_agent_keep_the_real_values(finished_run, crm):
    assert crm.calls[0]["arguments"] == {"body": f"Write to {EMAIL} about the order"}
    run = Run.objects.get(id=finished_run.id)
    assert run.state["email"] == EMAIL
    assert run.result == {"contacted": EMAIL}
    assert EMAIL in ToolCall.objects.get(run=run, tool_name="crm_note").arguments_masked["body"]


def test_the_masker_of_a_run_knows_the_values_its_tools_declared(finished_run):
    mask = masker_for(finished_run)
    assert mask({"a": EMAIL, "b": PHONE, "c": "555-0199", "d": "Carol"}) == {
        "a": MASK,
        "b": MASK,
        "c": MASK,
        "d": "Carol",
    }


def test_the_masker_is_empty_for_someone_who_may_see(finished_run, auditor_who_may_see):
    assert not masker_for(finished_run, user=auditor_who_may_see)


# --- the console --------------------------------------------------------------------------


def test_run_page_masks_state_result_arguments_receipts_and_events(client, finished_run, viewer):
    client.force_login(viewer)
    response = client.get(reverse("runs:detail", args=[finished_run.id]))
    assert response.status_code == 200
    page = response.content.decode()
    assert EMAIL not in page
    assert PHONE not in page
    assert MASK in page
    assert "Carol" in page  # what was not declared is shown


def test_run_page_shows_the_values_to_an_auditor_with_the_permission(
    client, finished_run, auditor_who_may_see
):
    client.force_login(auditor_who_may_see)
    page = client.get(reverse("runs:detail", args=[finished_run.id])).content.decode()
    assert EMAIL in page
    assert PHONE in page


def test_run_page_masks_for_an_auditor_without_the_permission(client, finished_run, plain_auditor):
    client.force_login(plain_auditor)
    page = client.get(reverse("runs:detail", args=[finished_run.id])).content.decode()
    assert EMAIL not in page


def test_older_events_page_masks_payloads(client, finished_run, viewer):
    client.force_login(viewer)
    last = Run.objects.get(id=finished_run.id).event_seq
    response = client.get(reverse("runs:events", args=[finished_run.id]), {"before": last + 1})
    assert response.status_code == 200
    page = response.content.decode()
    assert "run.succeeded" in page
    assert EMAIL not in page


# --- the API --------------------------------------------------------------------------------


def _api(client, user, path, **params):
    client.force_login(user)
    response = client.get(path, params)
    assert response.status_code == 200, response.content
    return response


def test_api_run_masks_state_and_result(client, finished_run, viewer, auditor_who_may_see):
    url = f"/api/v1/runs/{finished_run.id}/"
    body = _api(client, viewer, url).json()
    assert body["state"]["email"] == MASK
    assert body["result"] == {"contacted": MASK}
    assert EMAIL not in _api(client, viewer, url).content.decode()
    assert _api(client, auditor_who_may_see, url).json()["state"]["email"] == EMAIL


def test_api_events_and_tool_calls_mask_the_copies(
    client, finished_run, viewer, auditor_who_may_see
):
    events = f"/api/v1/runs/{finished_run.id}/events/"
    assert EMAIL not in _api(client, viewer, events).content.decode()
    assert EMAIL in _api(client, auditor_who_may_see, events).content.decode()
    calls = _api(client, viewer, "/api/v1/tool-calls/", run=str(finished_run.id)).json()
    note = next(c for c in calls["results"] if c["tool_name"] == "crm_note")
    assert note["arguments"] == {"body": f"Write to {MASK} about the order"}
    calls = _api(client, auditor_who_may_see, "/api/v1/tool-calls/", run=str(finished_run.id))
    assert EMAIL in calls.content.decode()


# --- unknown outcomes -------------------------------------------------------------------------


@pytest.fixture
def crm_unsafe(register):
    """``crm_send`` (unsafe) loses its answer, naming the address in the error: the inbox
    shows the call to an operator, masked."""

    def lose(arguments, ctx):
        raise OutcomeUnknown(f"timed out sending to {arguments['to']}")

    def decide(ctx):
        if not ctx.steps:
            return CallTool("crm_lookup2", {})
        return CallTool("crm_send", {"to": ctx.steps[0].output["customer"]["email"]})

    lookup = make_tool("crm_lookup2", CountingTool(lambda a, c: ToolResult(result=CRM_ANSWER)))
    lookup.sensitive_output = ("customer.email",)
    send = make_tool("crm_send", CountingTool(lose), effect=Effect.UNSAFE)
    register(lookup, send, ScriptedAgent("crm_sender", decide, tools=("crm_lookup2", "crm_send")))


def test_unknown_outcomes_inbox_masks_arguments_and_errors(
    client, crm_unsafe, system_actor, operator
):
    run = drive(run_create(agent_name="crm_sender", input={}, actor=system_actor).id)
    assert run.status == Run.Status.NEEDS_ATTENTION
    client.force_login(operator)
    page = client.get(reverse("runs:unknown")).content.decode()
    assert "crm_send" in page
    assert EMAIL not in page
    assert f"timed out sending to {MASK}" in page


def test_a_retired_tool_is_not_needed_to_show_a_run(finished_run, client, viewer):
    from runs.registry import registry

    tool = registry.tool("crm_note")
    registry.unregister_tool("crm_note")
    try:
        with pytest.raises(UnknownTool):
            registry.tool("crm_note")
        client.force_login(viewer)
        page = client.get(reverse("runs:detail", args=[finished_run.id])).content.decode()
        assert EMAIL not in page
    finally:
        registry.register_tool(tool)


# --- copies that leave the system: emails, webhooks, exports ----------------------------------


@pytest.fixture
def crm_people(register):
    """After the lookup, ``crm_asker`` either asks operators a question naming the address
    (input ``ask``) or proposes a note that needs an approver, with the address in a
    non-sensitive argument."""

    def decide(ctx):
        if not ctx.steps:
            return CallTool("crm_lookup3", {})
        email = ctx.steps[0].output["customer"]["email"]
        if ctx.input.get("ask"):
            return AskQuestion(f"Should we write to {email}?", group="operator")
        return CallTool("crm_approved_note", {"body": f"note for {email}"})

    lookup = make_tool("crm_lookup3", CountingTool(lambda a, c: ToolResult(result=CRM_ANSWER)))
    lookup.sensitive_output = ("customer.email",)
    note = make_tool("crm_approved_note", CountingTool(), approval=ApprovalPolicy(when="always"))
    register(
        lookup,
        note,
        ScriptedAgent("crm_asker", decide, tools=("crm_lookup3", "crm_approved_note")),
    )


def _with_address(user, address):
    user.email = address
    user.save(update_fields=["email"])
    return user


def test_approval_email_and_pages_mask_a_copied_value(
    crm_people, system_actor, approver, viewer, client, django_capture_on_commit_callbacks
):
    _with_address(approver, "alice@example.com")
    with django_capture_on_commit_callbacks(execute=True):
        run = drive(run_create(agent_name="crm_asker", input={}, actor=system_actor).id)
    assert run.status == Run.Status.WAITING_APPROVAL
    (message,) = [m for m in mail.outbox if "alice@example.com" in m.to]
    for body in (message.body, message.alternatives[0][0]):
        assert f"note for {MASK}" in body
        assert EMAIL not in body
    approval = Approval.objects.get(run=run)
    client.force_login(approver)
    page = client.get(reverse("approvals:detail", args=[approval.id])).content.decode()
    assert f"note for {MASK}" in page and EMAIL not in page


def test_question_email_masks_a_copied_value(
    crm_people, system_actor, operator, django_capture_on_commit_callbacks
):
    _with_address(operator, "olivia@example.com")
    with django_capture_on_commit_callbacks(execute=True):
        run = drive(run_create(agent_name="crm_asker", input={"ask": True}, actor=system_actor).id)
    assert run.status == Run.Status.WAITING_EVENT
    (message,) = [m for m in mail.outbox if "olivia@example.com" in m.to]
    assert EMAIL not in message.subject
    for body in (message.body, message.alternatives[0][0]):
        assert f"Should we write to {MASK}?" in body
        assert EMAIL not in body


def test_webhook_payload_is_masked_when_sent(crm, operator, settings):
    from runs.webhooks import webhooks_deliver_due
    from tests.api.test_webhooks import Receiver

    receiver = Receiver()
    try:
        api_token_create(
            name="hooks", principal=operator, actor=Actor.system("cli"), webhook_url=receiver.url
        )
        run = run_create(agent_name="crm_agent", input={}, actor=Actor.for_user(operator, "api"))
        assert drive(run.id).status == Run.Status.SUCCEEDED
        (delivery,) = WebhookDelivery.objects.filter(run_id=run.id)
        assert webhooks_deliver_due() == 1
        (_headers, body) = receiver.requests[-1]
        assert json.loads(body)["event"]["payload"]["result"] == {"contacted": MASK}
        assert EMAIL.encode() not in body
    finally:
        receiver.stop()


def test_audit_export_masks_payloads(finished_run):
    out = io.StringIO()
    call_command(
        "audit_export", since="2000-01-01", run=str(finished_run.id), format="jsonl", stdout=out
    )
    exported = out.getvalue()
    assert '"run.succeeded"' in exported
    assert EMAIL not in exported
    assert MASK in exported


# --- the admin: auditors read the record there -------------------------------------------------


def _admin_pages(run: Run) -> list[str]:
    call = ToolCall.objects.get(run=run, tool_name="crm_note")
    lookup = ToolCall.objects.get(run=run, tool_name="crm_lookup")
    finished = RunEvent.objects.get(run=run, type="run.succeeded")
    return [
        reverse("admin:runs_run_change", args=[run.id]),
        reverse("admin:runs_step_change", args=[lookup.step_id]),
        reverse("admin:runs_toolcall_change", args=[call.id]),
        reverse("admin:runs_toolreceipt_change", args=[lookup.receipt.id]),
        reverse("admin:runs_runevent_change", args=[finished.id]),
        reverse("admin:runs_runevent_export") + f"?run_id__exact={run.id}",
    ]


def _content(response) -> str:
    if response.streaming:
        return b"".join(response.streaming_content).decode()
    return response.content.decode()


def test_admin_masks_for_an_auditor_without_the_permission(client, finished_run, plain_auditor):
    client.force_login(plain_auditor)
    for url in _admin_pages(finished_run):
        response = client.get(url)
        assert response.status_code == 200, url
        content = _content(response)
        assert EMAIL not in content, url
        assert MASK in content, url


def test_admin_shows_the_values_to_an_auditor_with_the_permission(
    client, finished_run, auditor_who_may_see
):
    client.force_login(auditor_who_may_see)
    for url in _admin_pages(finished_run):
        response = client.get(url)
        assert response.status_code == 200, url
        assert EMAIL in _content(response), url


def test_the_record_is_unchanged_after_the_admin_showed_it(client, finished_run, plain_auditor):
    client.force_login(plain_auditor)
    for url in _admin_pages(finished_run):
        client.get(url)
    assert Run.objects.get(id=finished_run.id).state["email"] == EMAIL
    lookup = ToolCall.objects.get(run=finished_run, tool_name="crm_lookup")
    assert lookup.receipt.result == CRM_ANSWER


# --- the demo and remote manifests ------------------------------------------------------------


def test_the_demo_lookup_masks_the_customer_on_the_run_page(sandbox, system_actor, client, viewer):
    run = drive(
        run_create(
            agent_name="refund",
            input={"order_id": "ord_1001", "amount_cents": 100},
            actor=system_actor,
        ).id
    )
    customer = Run.objects.get(id=run.id).state["order"]["customer"]
    assert "@" in customer
    client.force_login(viewer)
    page = client.get(reverse("runs:detail", args=[run.id])).content.decode()
    assert customer not in page
    body = client.get(f"/api/v1/runs/{run.id}/").json()
    assert body["state"]["order"]["customer"] == MASK


def test_a_manifest_declares_sensitive_output_paths():
    from runs.models import AgentManifest
    from runs.remote.manifest import RemoteAgent, _tool_errors, manifest_tool

    spec = {"name": "crm", "effect": "read", "sensitive_output": ["customer.email"]}
    assert _tool_errors(spec) == []
    assert manifest_tool("remote_crm", spec).sensitive_output == ("customer.email",)
    agent = RemoteAgent(AgentManifest(name="remote_crm", version="1", tools=[spec]))
    assert agent.sensitive_outputs() == {"remote_crm/crm": ("customer.email",)}
    assert any(
        e.startswith("sensitive_output")
        for e in _tool_errors({**spec, "sensitive_output": ["a..b"]})
    )


def test_approvals_api_masks_a_copied_value(crm_people, system_actor, approver, client):
    run = drive(run_create(agent_name="crm_asker", input={}, actor=system_actor).id)
    client.force_login(approver)
    body = client.get("/api/v1/approvals/", {"run": str(run.id)}).json()
    (approval,) = body["results"]
    assert approval["arguments"] == {"body": f"note for {MASK}"}


def test_an_edit_that_sends_a_masked_field_back_as_shown_keeps_its_real_value(
    crm_people, system_actor, approver, client, register
):
    """The approver saw ``note for ***`` and sent it back unchanged beside another edit:
    the call is dispatched with the real address, not with the mask."""
    from approvals.services import _prepare_edit

    run = drive(run_create(agent_name="crm_asker", input={}, actor=system_actor).id)
    call = ToolCall.objects.get(run=run, tool_name="crm_approved_note")
    kept = _prepare_edit(call.id, {"body": f"note for {MASK}", "extra": 1})
    assert kept.arguments == {"body": f"note for {EMAIL}", "extra": 1}
    changed = _prepare_edit(call.id, {"body": "another note"})
    assert changed.arguments == {"body": "another note"}


def test_approval_admin_pages_mask_a_copied_value(
    crm_people, system_actor, approver, plain_auditor, client
):
    from approvals.models import ApprovalDecision
    from approvals.services import approval_decide

    run = drive(run_create(agent_name="crm_asker", input={}, actor=system_actor).id)
    approval = Approval.objects.get(run=run)
    approval_decide(
        approval_id=approval.id,
        decision="approve",
        actor=Actor.for_user(approver, "web"),
        edited_arguments={"body": f"note for {MASK}", "extra": 1},
    )
    decision = ApprovalDecision.objects.get(approval=approval, decision="approve")
    assert decision.edited_arguments["body"] == f"note for {EMAIL}"  # the record is real
    client.force_login(plain_auditor)
    for url in (
        reverse("admin:approvals_approval_change", args=[approval.id]),
        reverse("admin:approvals_approvaldecision_change", args=[decision.id]),
        reverse("admin:approvals_approvaldecision_export"),
    ):
        response = client.get(url)
        assert response.status_code == 200, url
        content = _content(response)
        assert EMAIL not in content, url
        assert MASK in content, url


def test_question_pages_mask_a_copied_value(crm_people, system_actor, operator, client):
    run = drive(run_create(agent_name="crm_asker", input={"ask": True}, actor=system_actor).id)
    question = Question.objects.get(run=run)
    assert EMAIL in question.text  # the record is real
    client.force_login(operator)
    for url in (reverse("runs:questions"), reverse("runs:question", args=[question.id])):
        page = client.get(url).content.decode()
        assert f"Should we write to {MASK}?" in page, url
        assert EMAIL not in page, url


def test_dashboard_masks_the_reason_a_run_needs_a_person(
    client, crm_unsafe, system_actor, operator
):
    run = drive(run_create(agent_name="crm_sender", input={}, actor=system_actor).id)
    assert run.status == Run.Status.NEEDS_ATTENTION
    Run.objects.filter(id=run.id).update(reason_detail=f"could not reach {EMAIL}")
    client.force_login(operator)  # "Needs you" lists it for who may act on it
    page = client.get(reverse("runs:dashboard")).content.decode()
    assert f"could not reach {MASK}" in page
    assert EMAIL not in page


def test_an_alert_about_a_run_is_stored_and_emailed_masked(
    crm_unsafe, system_actor, operator, django_capture_on_commit_callbacks
):
    from runs.alerts import alerts_check
    from runs.models import Alert

    _with_address(operator, "olivia@example.com")
    run = drive(run_create(agent_name="crm_sender", input={}, actor=system_actor).id)
    Run.objects.filter(id=run.id).update(reason_detail=f"could not reach {EMAIL}")
    with django_capture_on_commit_callbacks(execute=True):
        alerts_check()
    alert = Alert.objects.get(run_id=run.id)
    assert f"could not reach {MASK}" in alert.detail
    assert EMAIL not in alert.detail
    (message,) = [m for m in mail.outbox if "olivia@example.com" in m.to]
    assert EMAIL not in message.body


def test_the_approvals_inbox_masks_a_copied_value(crm_people, system_actor, approver, client):
    run = drive(run_create(agent_name="crm_asker", input={}, actor=system_actor).id)
    assert run.status == Run.Status.WAITING_APPROVAL
    client.force_login(approver)

    page = client.get(reverse("approvals:inbox")).content.decode()

    assert f"note for {MASK}" in page and EMAIL not in page

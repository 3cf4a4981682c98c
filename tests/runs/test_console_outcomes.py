"""The unknown-outcomes inbox (``runs:unknown``) and its resolutions through the page."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.conf import settings
from django.contrib.auth import get_user_model
from django.contrib.auth.models import Group
from django.urls import reverse
from django.utils import timezone

from runs.models import Run, Step, ToolCall, ToolReceipt
from runs.registry import CallTool, Effect, Finish, LookupResult, OutcomeUnknown, Reconciliation
from runs.services import run_create, run_terminate
from tests.conftest import drive
from tests.support import CountingTool, ScriptedAgent, events, make_tool, rewind

pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("roles")]

INBOX = "/unknown/"


@pytest.fixture(autouse=True)
def _windows(monkeypatch):
    monkeypatch.setitem(settings.AGENTOPS, "RECONCILE_MAX_ATTEMPTS", 2)
    monkeypatch.setitem(settings.AGENTOPS, "RECONCILE_BACKOFF", 0.2)
    monkeypatch.setitem(settings.AGENTOPS, "REDISPATCH_MARGIN", 0.5)


def _finish_with_last_step(ctx):
    last = ctx.last_step
    return Finish({"status": last.status, "output": last.output, "error": last.error})


@pytest.fixture
def unsafe(register):
    """An unsafe tool whose every call loses its outcome (the sensitive ``token`` is masked)."""

    def behaviour(arguments, ctx):
        raise OutcomeUnknown("connection reset by peer")

    body = CountingTool(behaviour)
    tool = make_tool("outcome_notify", body, effect=Effect.UNSAFE)
    tool.sensitive_fields = ("token",)

    def decide(ctx):
        if not ctx.steps:
            return CallTool("outcome_notify", {"to": "c@example.com", "token": "s3cr3t-t0k3n"})
        return _finish_with_last_step(ctx)

    register(tool, ScriptedAgent("outcome_notifier", decide, tools=("outcome_notify",)))
    return body


@pytest.fixture
def undecidable(register):
    """A reconcilable tool whose outcome is lost and whose lookup cannot tell, until told."""
    plan = {"lookup": LookupResult.UNKNOWN}
    lookups: list[str] = []

    def behaviour(arguments, ctx):
        raise OutcomeUnknown("timed out")

    def lookup(key, arguments):
        lookups.append(key)
        if plan["lookup"] == LookupResult.FOUND:
            return Reconciliation(LookupResult.FOUND, result={"found": key}, external_ref="tx-9")
        return Reconciliation(plan["lookup"], detail="the ledger is down")

    body = CountingTool(behaviour)
    register(
        make_tool("outcome_transfer", body, effect=Effect.RECONCILABLE, reconcile=lookup),
        ScriptedAgent(
            "outcome_transferer",
            lambda ctx: (
                CallTool("outcome_transfer", {"amount": 7})
                if not ctx.steps
                else _finish_with_last_step(ctx)
            ),
            tools=("outcome_transfer",),
        ),
    )
    return body, plan, lookups


@pytest.fixture
def admin_user(django_user_model):
    user = django_user_model.objects.create_user(username="ada", password="pw-ada")
    user.groups.add(Group.objects.get(name="admin"))
    return user


def _stuck_unsafe(system_actor) -> ToolCall:
    run = drive(run_create(agent_name="outcome_notifier", actor=system_actor).id)
    assert (run.status, run.reason_code) == (Run.Status.NEEDS_ATTENTION, "unknown_outcome")
    return ToolCall.objects.select_related("run", "step").get(run=run)


def _stuck_reconcilable(system_actor) -> ToolCall:
    run = run_create(agent_name="outcome_transferer", actor=system_actor)
    for _ in range(5):
        run = drive(run.id)
        if run.status == Run.Status.NEEDS_ATTENTION:
            return ToolCall.objects.select_related("run", "step").get(run=run)
        rewind(run.id)
    raise AssertionError(f"run is {run.status}")


def _resolve_url(call: ToolCall) -> str:
    return reverse("runs:resolve", args=[call.id])


def _snapshot(call: ToolCall) -> tuple:
    call = ToolCall.objects.get(id=call.id)
    run = Run.objects.get(id=call.run_id)
    return (
        call.status,
        call.redispatch_authorized,
        call.reconcile_attempts,
        ToolReceipt.objects.filter(tool_call=call).exists(),
        run.status,
        run.event_seq,
    )


# --- the inbox ------------------------------------------------------------------------------


def test_anonymous_is_sent_to_sign_in(client):
    response = client.get(INBOX)
    assert response.status_code == 302 and response["Location"].startswith("/accounts/login/")


@pytest.mark.parametrize("role", ["viewer", "operator", "approver", "admin_user"])
def test_every_role_may_look(client, request, role):
    client.force_login(request.getfixturevalue(role))
    response = client.get(INBOX)
    assert response.status_code == 200
    assert "No unknown outcomes." in response.content.decode()  # the empty state says why


def test_a_user_without_a_role_is_refused(client):
    client.force_login(get_user_model().objects.create_user(username="nobody", password="pw"))
    response = client.get(INBOX)
    assert response.status_code == 403
    assert "runs.view_toolcall" in response.content.decode()


def test_inbox_shows_each_call_oldest_first_with_its_story(
    client, operator, unsafe, undecidable, system_actor
):
    older = _stuck_reconcilable(system_actor)
    newer = _stuck_unsafe(system_actor)
    ToolCall.objects.filter(id=older.id).update(
        dispatched_at=timezone.now() - timedelta(minutes=30)
    )
    client.force_login(operator)

    response = client.get(INBOX)

    html = response.content.decode()
    assert [r["call"].id for r in response.context["waiting"]] == [older.id, newer.id]
    assert html.index(f'id="call-{older.id}"') < html.index(f'id="call-{newer.id}"')
    # the request, masked; the key; the attempts; every lookup and its answer
    assert "s3cr3t-t0k3n" not in html and "&quot;***&quot;" in html
    assert older.idempotency_key in html and newer.idempotency_key in html
    assert "2 lookups since a person last looked" in html
    history = [e.text for e in response.context["waiting"][0]["history"]]
    assert history[0].startswith("call #1 (outcome_transfer) dispatching, attempt 1")
    assert any(t.startswith("call #1 (outcome_transfer) outcome unknown:") for t in history)
    assert any("timed out" in t for t in history)
    lookups = [t for t in history if "looked up by key" in t]
    assert len(lookups) == 2 and all("unknown (the ledger is down)" in t for t in lookups)
    assert f'href="{reverse("runs:detail", args=[older.run_id])}"' in html
    # the risk is stated for the unsafe tool, and only its lookup-less actions are offered
    assert "Unsafe tool:" in html and 'name="confirm_risk"' in html
    unsafe_row = response.context["waiting"][1]
    assert unsafe_row["unsafe"] and not unsafe_row["may_reconcile"]
    assert response.context["waiting"][0]["may_reconcile"]


def test_calls_the_engine_still_handles_or_on_ended_runs_offer_no_actions(
    client, operator, unsafe, system_actor
):
    call = _stuck_unsafe(system_actor)
    run_terminate(run_id=call.run_id, actor=system_actor, reason="gave up")
    client.force_login(operator)

    response = client.get(INBOX)

    assert [r["call"].id for r in response.context["ended"]] == [call.id]
    html = response.content.decode()
    assert "can no longer be resolved here" in html
    assert _resolve_url(call) not in html


def test_inbox_query_count_does_not_grow_with_calls(
    client, operator, unsafe, system_actor, django_assert_num_queries
):
    _stuck_unsafe(system_actor)
    client.force_login(operator)
    # session, user, 2 permission queries, calls, events, and the receipts of tools that
    # declare a sensitive output (runs.masking)
    with django_assert_num_queries(7):
        client.get(INBOX)
    _stuck_unsafe(system_actor)
    _stuck_unsafe(system_actor)
    with django_assert_num_queries(7):
        response = client.get(INBOX)
    assert len(response.context["waiting"]) == 3


def test_a_long_inbox_shows_the_oldest_and_says_how_many_wait(
    client, operator, unsafe, system_actor, monkeypatch
):
    from runs import selectors

    calls = [_stuck_unsafe(system_actor) for _ in range(3)]
    monkeypatch.setattr(selectors, "UNKNOWN_SHOWN", 2)
    client.force_login(operator)

    response = client.get(INBOX)

    assert [r["call"].id for r in response.context["waiting"]] == [c.id for c in calls[:2]]
    assert "3 calls with an unknown outcome — the oldest 2 are shown" in response.content.decode()


# --- resolving: permissions ---------------------------------------------------------------


RESOLUTIONS = {
    "happened": {"outcome": "happened", "external_ref": "ntf_42"},
    "not_happened": {"outcome": "not_happened", "attestation": "checked the provider's log"},
    "dispatch_again": {"outcome": "dispatch_again", "confirm_risk": "on"},
}


@pytest.mark.parametrize("outcome", sorted(RESOLUTIONS))
def test_anonymous_cannot_resolve(client, unsafe, system_actor, outcome):
    call = _stuck_unsafe(system_actor)
    before = _snapshot(call)
    response = client.post(_resolve_url(call), RESOLUTIONS[outcome])
    assert response.status_code == 302 and response["Location"].startswith("/accounts/login/")
    assert _snapshot(call) == before


@pytest.mark.parametrize("role", ["viewer", "approver"])
@pytest.mark.parametrize("outcome", sorted(RESOLUTIONS))
def test_roles_without_resolve_are_refused(client, unsafe, system_actor, request, role, outcome):
    call = _stuck_unsafe(system_actor)
    before = _snapshot(call)
    client.force_login(request.getfixturevalue(role))

    response = client.post(_resolve_url(call), RESOLUTIONS[outcome])

    assert response.status_code == 403
    assert "runs.resolve_toolcall" in response.content.decode()
    assert _snapshot(call) == before


@pytest.mark.parametrize("role", ["operator", "admin_user"])
@pytest.mark.parametrize("outcome", sorted(RESOLUTIONS))
def test_operators_resolve_and_the_run_timeline_names_them(
    client, unsafe, system_actor, request, role, outcome
):
    call = _stuck_unsafe(system_actor)
    user = request.getfixturevalue(role)
    client.force_login(user)

    response = client.post(_resolve_url(call), RESOLUTIONS[outcome])

    assert response.status_code == 302 and response["Location"] == INBOX
    (resolved,) = events(call.run_id, "tool.resolved")
    assert (resolved.actor, resolved.channel) == (f"user:{user.username}", "web")
    assert resolved.payload["outcome"] == outcome
    assert Run.objects.get(id=call.run_id).status == Run.Status.QUEUED
    inbox = client.get(INBOX)
    assert "resolved" in inbox.content.decode()  # the success message
    assert call.id not in [r["call"].id for r in inbox.context["waiting"]]
    page = client.get(reverse("runs:detail", args=[call.run_id])).content.decode()
    assert f"resolved as {outcome} by user:{user.username}" in page


# --- resolving: what each does --------------------------------------------------------------


def test_happened_with_reference_and_result_records_an_operator_receipt(
    client, operator, unsafe, system_actor
):
    call = _stuck_unsafe(system_actor)
    client.force_login(operator)

    client.post(
        _resolve_url(call),
        {"outcome": "happened", "external_ref": " ntf_42 ", "result": '{"id": "ntf_42"}'},
    )

    call.refresh_from_db()
    receipt = call.receipt
    assert (call.status, receipt.source) == (ToolCall.Status.SUCCEEDED, "operator")
    assert (receipt.external_ref, receipt.result) == ("ntf_42", {"id": "ntf_42"})
    assert receipt.recorded_by == "user:olivia"
    run = drive(call.run_id)
    assert run.status == Run.Status.SUCCEEDED and run.result["output"] == {"id": "ntf_42"}
    assert len(unsafe.calls) == 1  # never sent again


def test_not_happened_fails_the_step_and_the_agent_goes_on(client, operator, unsafe, system_actor):
    call = _stuck_unsafe(system_actor)
    client.force_login(operator)

    client.post(
        _resolve_url(call), {"outcome": "not_happened", "attestation": "checked the provider's log"}
    )

    assert Step.objects.get(id=call.step_id).status == Step.Status.FAILED
    run = drive(call.run_id)
    assert run.result["status"] == "failed" and len(unsafe.calls) == 1


def test_dispatch_again_of_an_unsafe_tool_records_the_confirmed_risk(
    client, operator, unsafe, system_actor
):
    call = _stuck_unsafe(system_actor)
    client.force_login(operator)

    client.post(_resolve_url(call), {"outcome": "dispatch_again", "confirm_risk": "on"})

    call.refresh_from_db()
    assert (call.status, call.redispatch_authorized) == (ToolCall.Status.UNKNOWN, True)
    (resolved,) = events(call.run_id, "tool.resolved")
    assert resolved.payload["confirmed_risk"] is True
    drive(call.run_id)
    assert len(unsafe.calls) == 1  # not before the first request can no longer land
    rewind(call.run_id)
    drive(call.run_id)
    assert len(unsafe.calls) == 2
    assert [c["key"] for c in unsafe.calls] == [call.idempotency_key] * 2


def test_reconcile_again_looks_the_key_up_afresh(client, operator, undecidable, system_actor):
    body, plan, lookups = undecidable
    call = _stuck_reconcilable(system_actor)
    client.force_login(operator)
    page = client.get(INBOX).content.decode()
    assert 'name="outcome" value="reconcile"' in page
    plan["lookup"] = LookupResult.FOUND

    response = client.post(_resolve_url(call), {"outcome": "reconcile"})

    assert response.status_code == 302
    call.refresh_from_db()
    assert call.reconcile_attempts == 0
    run = drive(call.run_id)
    assert run.status == Run.Status.SUCCEEDED
    call.refresh_from_db()
    assert (call.receipt.source, call.receipt.external_ref) == ("reconciliation", "tx-9")
    assert len(body.calls) == 1


def test_htmx_resolution_replaces_the_card_and_signals_the_change(
    client, operator, unsafe, system_actor
):
    call = _stuck_unsafe(system_actor)
    client.force_login(operator)

    response = client.post(
        _resolve_url(call), {"outcome": "happened", "external_ref": "n1"}, HTTP_HX_REQUEST="true"
    )

    assert response.status_code == 200
    assert response["HX-Trigger"] == "outcomes-changed, runs-changed"
    html = response.content.decode()
    assert html.lstrip().startswith(
        f'<article class="panel outcome outcome-resolved" id="call-{call.id}"'
    )
    assert "resolved: it happened" in html and "badge-call-succeeded" in html


# --- bad input changes nothing -------------------------------------------------------------


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"outcome": "dispatch_again"}, "Tick the box to confirm you accept that risk"),
        ({"outcome": "happened"}, "Give the external system&#x27;s reference and/or the result"),
        ({"outcome": "happened", "result": "{not json"}, "Not valid JSON"),
        ({"outcome": "happened", "result": '"\\u0000"'}, "NUL characters"),
        ({"outcome": "happened", "external_ref": "x" * 201}, "at most 200 characters"),
        ({"outcome": "maybe"}, "Select a valid choice"),
        ({"outcome": "reconcile"}, "has no lookup by key"),
    ],
)
def test_bad_input_is_a_form_error_and_changes_nothing(
    client, operator, unsafe, system_actor, data, message
):
    call = _stuck_unsafe(system_actor)
    before = _snapshot(call)
    client.force_login(operator)

    response = client.post(_resolve_url(call), data)

    assert response.status_code in (400, 409)
    assert message in response.content.decode()
    assert _snapshot(call) == before

    htmx = client.post(_resolve_url(call), data, HTTP_HX_REQUEST="true")
    assert htmx.status_code == response.status_code and message in htmx.content.decode()
    assert "<html" not in htmx.content.decode()
    assert f'id="call-{call.id}"' in htmx.content.decode()
    assert _snapshot(call) == before


def test_resolving_twice_is_a_conflict_not_a_500(client, operator, unsafe, system_actor):
    call = _stuck_unsafe(system_actor)
    client.force_login(operator)
    client.post(
        _resolve_url(call), {"outcome": "not_happened", "attestation": "checked the provider's log"}
    )
    before = _snapshot(call)

    response = client.post(_resolve_url(call), {"outcome": "happened", "external_ref": "n"})

    assert response.status_code == 409
    assert "not waiting for a person" in response.content.decode()
    assert _snapshot(call) == before


def test_unknown_call_is_404_and_get_is_refused(client, operator):
    client.force_login(operator)
    assert client.post("/tool-calls/999999/resolve/", {"outcome": "reconcile"}).status_code == 404
    huge = f"/tool-calls/{2**70}/resolve/"  # past any row id: SQLite cannot even bind it
    assert client.post(huge, {"outcome": "reconcile"}).status_code == 404
    assert client.get("/tool-calls/999999/resolve/").status_code == 405


def test_not_happened_without_proof_asks_for_an_attestation(client, operator, unsafe, system_actor):
    call = _stuck_unsafe(system_actor)
    client.force_login(operator)
    page = client.get("/unknown/").content.decode()
    assert f'id="id_attest_{call.id}" name="attestation"' in page
    assert "Latest lookup:" in page
    # the request as a table, masked values masked (issue 21 item 1)
    assert '<tr><th scope="row">token</th><td>***</td></tr>' in page
    assert "s3cr3t-t0k3n" not in page
    before = _snapshot(call)

    response = client.post(_resolve_url(call), {"outcome": "not_happened"})

    assert response.status_code == 400
    assert "attest why you know it did not happen" in response.content.decode()
    assert _snapshot(call) == before


# --- triage: many at once, by tool and time window (issue 21 item 4) --------------------------

TRIAGE = "/unknown/triage/"


def test_triage_lists_waiting_calls_by_tool_with_their_latest_lookup(
    client, operator, unsafe, system_actor
):
    first, second = _stuck_unsafe(system_actor), _stuck_unsafe(system_actor)
    client.force_login(operator)

    page = client.get(TRIAGE, {"tool": "outcome_notify"}).content.decode()
    other_tool = client.get(TRIAGE, {"tool": "refund_payment"}).content.decode()
    before_any = client.get(TRIAGE, {"until": "2000-01-01T00:00"}).content.decode()

    for call in (first, second):
        assert f'name="call" value="{call.id}" form="triage-form"' in page
        assert f'name="call" value="{call.id}"' not in other_tool
        assert f'name="call" value="{call.id}"' not in before_any
    assert "no lookup (unsafe: none possible)" in page
    assert "s3cr3t-t0k3n" not in page  # masked
    assert f'href="/runs/{first.run_id}/"' in page


def test_triage_marks_failed_only_with_an_attestation_where_nothing_proves_absence(
    client, operator, unsafe, system_actor
):
    first, second = _stuck_unsafe(system_actor), _stuck_unsafe(system_actor)
    client.force_login(operator)
    ids = [first.id, second.id]

    refused = client.post(TRIAGE, {"outcome": "not_happened", "call": ids}).content.decode()
    assert refused.count("Refused: no lookup that started after the landing deadline") == 2
    assert set(ToolCall.objects.filter(id__in=ids).values_list("status", flat=True)) == {"unknown"}

    done = client.post(
        TRIAGE,
        {"outcome": "not_happened", "call": ids, "attestation": "provider outage: none sent"},
    )
    assert done.content.decode().count("Done: mark as not happened") == 2
    assert done["HX-Trigger"] == "outcomes-changed, runs-changed"
    for call in (first, second):
        [resolved] = events(call.run_id, "tool.resolved")
        assert resolved.actor == "user:olivia"
        assert resolved.payload["attestation"] == "provider outage: none sent"
        assert resolved.payload["absence_proven"] is False


def test_triage_refuses_who_may_not_resolve(client, viewer, unsafe, system_actor):
    call = _stuck_unsafe(system_actor)
    client.force_login(viewer)
    response = client.post(
        TRIAGE, {"outcome": "not_happened", "call": [call.id], "attestation": "x"}
    )
    assert response.status_code == 403
    assert ToolCall.objects.get(id=call.id).status == "unknown"

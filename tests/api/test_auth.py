"""Bearer tokens: random, stored hashed, revocable, expiring, acting as their principal; the
create_api_token command; the error shape for authentication, throttling and unknown URLs."""

from __future__ import annotations

import hashlib
from datetime import timedelta
from io import StringIO

import pytest
from django.core.management import CommandError, call_command
from django.utils import timezone
from rest_framework.test import APIClient
from rest_framework.throttling import UserRateThrottle

from runs.actors import Actor, PermissionDenied
from runs.models import ApiToken, RunEvent
from runs.services import InvalidInput, InvalidState
from runs.tokens import api_token_create, api_token_revoke
from tests.api.conftest import assert_error, client_for, token_for

# each request commits or rolls back on its own, as in production (a service error
# rolls back the whole transaction it opened)
pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("roles")]


def _bearer(raw: str) -> APIClient:
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {raw}")
    return client


def test_token_is_stored_only_as_its_hash(operator):
    token, raw = api_token_create(name="ci", principal=operator, actor=Actor.system("cli"))

    assert raw.startswith("ao_") and len(raw) > 40
    assert token.token_hash == hashlib.sha256(raw.encode()).hexdigest()
    assert token.prefix == raw[:10]
    stored = ApiToken.objects.filter(pk=token.pk).values()[0]
    assert raw not in {str(value) for value in stored.values()}


def test_two_tokens_are_different(operator):
    assert token_for(operator, "a") != token_for(operator, "b")


def test_token_acts_as_its_principal_and_records_use(operator):
    raw = token_for(operator, "ci")

    response = _bearer(raw).get("/api/v1/runs/")

    assert response.status_code == 200
    assert ApiToken.objects.get(name="ci").last_used_at is not None


def test_last_used_is_not_written_on_every_request(operator, django_assert_num_queries):
    client = _bearer(token_for(operator, "ci"))
    client.get("/api/v1/agents/")  # first use writes last_used_at
    # token lookup (with principal) + the remote agents' manifests, no UPDATE
    with django_assert_num_queries(2):
        client.get("/api/v1/agents/")


def test_state_change_names_the_token_and_the_api_channel(operator, api_agents):
    client = _bearer(token_for(operator, "ci-bot"))

    response = client.post("/api/v1/runs/", {"agent": "api_payer", "input": {"amount_cents": 1}})

    assert response.status_code == 201
    event = RunEvent.objects.get(run_id=response.json()["id"], type="run.created")
    assert (event.actor, event.channel) == ("token:ci-bot", "api")


@pytest.mark.parametrize(
    "header",
    ["Bearer nope", "Bearer", "Bearer a b", "Bearer ao_" + "x" * 43],
)
def test_bad_token_is_not_authenticated(header):
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=header)

    response = client.get("/api/v1/runs/")

    assert_error(response, 401, "not_authenticated")
    assert response["WWW-Authenticate"].startswith("Bearer")


def test_no_credentials_is_not_authenticated(anonymous):
    assert_error(anonymous.get("/api/v1/runs/"), 401, "not_authenticated")
    assert_error(anonymous.post("/api/v1/runs/", {}, format="json"), 401, "not_authenticated")


def test_revoked_token_stops_working(operator):
    raw = token_for(operator, "ci")
    token = ApiToken.objects.get(name="ci")

    api_token_revoke(token_id=token.id, actor=Actor.system("cli"))

    assert_error(_bearer(raw).get("/api/v1/runs/"), 401, "not_authenticated")
    with pytest.raises(InvalidState):
        api_token_revoke(token_id=token.id, actor=Actor.system("cli"))


def test_expired_token_stops_working(operator):
    token, raw = api_token_create(
        name="ci",
        principal=operator,
        actor=Actor.system("cli"),
        expires_at=timezone.now() + timedelta(hours=1),
    )
    assert _bearer(raw).get("/api/v1/runs/").status_code == 200

    ApiToken.objects.filter(pk=token.pk).update(expires_at=timezone.now() - timedelta(seconds=1))

    assert_error(_bearer(raw).get("/api/v1/runs/"), 401, "not_authenticated")


def test_token_of_a_deactivated_principal_stops_working(operator):
    raw = token_for(operator)
    operator.is_active = False
    operator.save(update_fields=["is_active"])

    assert_error(_bearer(raw).get("/api/v1/runs/"), 401, "not_authenticated")


def test_token_names_are_unique(operator):
    api_token_create(name="ci", principal=operator, actor=Actor.system("cli"))
    with pytest.raises(InvalidInput, match="already exists"):
        api_token_create(name="ci", principal=operator, actor=Actor.system("cli"))


def test_only_token_admins_create_tokens(operator):
    with pytest.raises(PermissionDenied):
        api_token_create(name="x", principal=operator, actor=Actor.for_user(operator, "admin"))


def test_session_auth_works_for_signed_in_users(operator):
    client = APIClient(enforce_csrf_checks=True)
    client.force_login(operator)

    assert client.get("/api/v1/runs/").status_code == 200
    # session writes need the CSRF token, like any form post
    response = client.post("/api/v1/runs/", {"agent": "x"}, format="json")
    assert_error(response, 403, "permission_denied")
    assert "CSRF" in response.json()["detail"]


def test_throttled_requests_get_the_throttled_code(operator, monkeypatch):
    from django.core.cache import cache

    cache.clear()
    monkeypatch.setattr(UserRateThrottle, "THROTTLE_RATES", {"user": "2/min", "anon": "2/min"})
    client = client_for(operator)
    client.get("/api/v1/agents/")
    client.get("/api/v1/agents/")

    response = client.get("/api/v1/agents/")

    assert_error(response, 429, "throttled")
    assert int(response["Retry-After"]) > 0
    cache.clear()


def test_unknown_api_url_is_a_json_not_found(as_operator):
    assert_error(as_operator.get("/api/v1/nope/"), 404, "not_found")
    assert_error(as_operator.get("/api/v1/runs/not-a-uuid/"), 404, "not_found")


def test_wrong_method_and_media_type_keep_the_error_shape(as_operator):
    assert_error(as_operator.delete("/api/v1/runs/"), 405, "method_not_allowed")
    response = as_operator.post("/api/v1/runs/", "agent=x", content_type="text/plain")
    assert_error(response, 415, "unsupported_media_type")
    response = as_operator.post("/api/v1/runs/", "{nope", content_type="application/json")
    assert_error(response, 400, "validation_error")


# --- the command ----------------------------------------------------------------------------


def test_create_api_token_prints_the_token_alone_on_its_last_line(operator):
    out, err = StringIO(), StringIO()

    call_command("create_api_token", "ci", "--principal", operator.username, stdout=out, stderr=err)

    raw = out.getvalue().strip().splitlines()[-1]
    assert raw.startswith("ao_") and " " not in raw
    assert _bearer(raw).get("/api/v1/runs/").status_code == 200
    assert "shown only now" in err.getvalue()


def test_create_api_token_with_expiry(operator):
    out = StringIO()

    call_command(
        "create_api_token",
        "ci",
        "--principal",
        operator.username,
        "--expires-days",
        "7",
        stdout=out,
    )

    token = ApiToken.objects.get(name="ci")
    assert timedelta(days=6) < token.expires_at - timezone.now() <= timedelta(days=7)


def test_create_api_token_refuses_an_unknown_user():
    with pytest.raises(CommandError, match="no user named 'ghost'"):
        call_command("create_api_token", "ci", "--principal", "ghost", stdout=StringIO())


def test_create_api_token_refuses_a_duplicate_name(operator):
    call_command("create_api_token", "ci", "--principal", operator.username, stdout=StringIO())
    with pytest.raises(CommandError, match="already exists"):
        call_command("create_api_token", "ci", "--principal", operator.username, stdout=StringIO())


# --- the admin ------------------------------------------------------------------------------


def test_admin_add_shows_the_raw_token_once(admin_client, operator):
    response = admin_client.post(
        "/admin/runs/apitoken/add/",
        {"name": "from-admin", "principal": operator.pk, "expires_at_0": "", "expires_at_1": ""},
    )

    assert response.status_code == 200, response.content
    token = ApiToken.objects.get(name="from-admin")
    raw = response.context["raw_token"]
    assert token.token_hash == hashlib.sha256(raw.encode()).hexdigest()
    assert token.created_by == "user:admin"
    assert _bearer(raw).get("/api/v1/runs/").status_code == 200


def test_admin_revoke_action(admin_client, operator):
    raw = token_for(operator, "ci")
    token = ApiToken.objects.get(name="ci")

    admin_client.post(
        "/admin/runs/apitoken/",
        {"action": "revoke_tokens", "_selected_action": [token.pk]},
    )

    assert ApiToken.objects.get(pk=token.pk).revoked_at is not None
    assert_error(_bearer(raw).get("/api/v1/runs/"), 401, "not_authenticated")

"""Sign-in (issue 17): locked out per username *and* address after repeated failures, lockouts
and unlocks audited, Django's full password rules, an idle session signed out."""

from __future__ import annotations

import time
from io import StringIO

import pytest
from axes.models import AccessAttempt
from django.contrib.auth.password_validation import validate_password
from django.core.exceptions import ValidationError
from django.core.management import call_command

from runs.middleware import LAST_ACTIVE_KEY
from runs.models import AuditEntry

pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("roles")]

HERE, ELSEWHERE = "198.51.100.7", "203.0.113.9"


def _sign_in(client, username: str, password: str, address: str):
    return client.post(
        "/accounts/login/", {"username": username, "password": password}, REMOTE_ADDR=address
    )


def _fail(client, username: str, address: str, times: int) -> None:
    for _ in range(times):
        _sign_in(client, username, "not-the-password", address)


def test_five_failures_lock_that_username_out_from_that_address_only(client, approver):
    _fail(client, "alice", HERE, 5)

    # the right password no longer helps from here
    response = _sign_in(client, "alice", "pw-alice", HERE)
    assert response.status_code == 429
    assert b"Too many failed sign-ins" in response.content
    assert "_auth_user_id" not in client.session

    # the approver, elsewhere, signs in as usual: nobody locks a person out by name alone
    response = _sign_in(client, "alice", "pw-alice", ELSEWHERE)
    assert response.status_code == 302
    assert client.session["_auth_user_id"] == str(approver.pk)


def test_four_failures_do_not_lock_and_a_success_clears_them(client, approver):
    _fail(client, "alice", HERE, 4)
    assert _sign_in(client, "alice", "pw-alice", HERE).status_code == 302
    client.logout()
    assert not AccessAttempt.objects.exists()
    _fail(client, "alice", HERE, 4)
    assert _sign_in(client, "alice", "pw-alice", HERE).status_code == 302


def test_the_admin_login_is_locked_out_the_same_way(client, approver):
    for _ in range(5):
        client.post("/admin/login/", {"username": "alice", "password": "nope"}, REMOTE_ADDR=HERE)
    response = client.post(
        "/admin/login/", {"username": "alice", "password": "pw-alice"}, REMOTE_ADDR=HERE
    )
    assert response.status_code == 429


def test_a_lockout_is_one_audit_entry_however_long_someone_keeps_trying(client, approver):
    _fail(client, "alice", HERE, 9)

    assert not AuditEntry.objects.filter(action="auth.sign_in_failed").exists()
    (entry,) = AuditEntry.objects.filter(action="auth.locked_out")
    assert (entry.actor, entry.channel, entry.ip_address) == ("anonymous", "web", HERE)
    assert entry.after["username"] == "alice"
    assert entry.after["failures"] == 5
    assert entry.after["locked_for_seconds"] == 15 * 60
    call_command("audit_verify", stdout=StringIO())


def test_an_admin_unlock_is_audited_with_who_and_lets_the_person_in(
    client, approver, django_user_model
):
    django_user_model.objects.create_superuser("root", password="pw-root")
    _fail(client, "alice", HERE, 5)
    attempt = AccessAttempt.objects.get(username="alice")

    admin = client.__class__()
    admin.force_login(django_user_model.objects.get(username="root"))
    response = admin.post(
        "/admin/axes/accessattempt/",
        {"action": "delete_selected", "_selected_action": [attempt.pk], "post": "yes"},
    )
    assert response.status_code == 302, response.content

    (entry,) = AuditEntry.objects.filter(action="auth.unlocked")
    assert (entry.actor, entry.channel) == ("user:root", "admin")
    assert (entry.after["username"], entry.after["ip_address"]) == ("alice", HERE)
    assert _sign_in(client, "alice", "pw-alice", HERE).status_code == 302


def test_an_unlock_from_the_command_line_is_audited(client, approver):
    _fail(client, "alice", HERE, 5)
    _fail(client, "bob", HERE, 2)  # not locked: clearing it unlocks nobody

    call_command("axes_reset", stdout=StringIO())

    (entry,) = AuditEntry.objects.filter(action="auth.unlocked")
    assert (entry.actor, entry.channel, entry.after["username"]) == ("system", "cli", "alice")


def test_the_locked_out_admin_page_needs_no_add_or_change(admin_client):
    assert admin_client.get("/admin/axes/accessattempt/").status_code == 200
    assert admin_client.get("/admin/axes/accessattempt/add/").status_code == 403


def test_passwords_follow_djangos_full_rules(django_user_model):
    user = django_user_model(username="margaret", email="margaret@example.com")
    for weak, rule in [
        ("short-1", "too short"),
        ("123456789012345", "entirely numeric"),
        ("qwerty123456", "too common"),
        ("margaret@example.com", "too similar"),
    ]:
        with pytest.raises(ValidationError, match=rule):
            validate_password(weak, user)
    validate_password("correct horse battery staple", user)


def test_an_idle_session_is_signed_out_and_polls_do_not_keep_it_alive(client, operator, settings):
    client.force_login(operator)
    assert client.get("/").status_code == 200
    last = client.session[LAST_ACTIVE_KEY]

    # an htmx refresh of an open page is not activity
    assert client.get("/", HTTP_HX_REQUEST="true").status_code == 200
    assert client.session[LAST_ACTIVE_KEY] == last

    session = client.session
    session[LAST_ACTIVE_KEY] = time.time() - settings.SESSION_IDLE_TIMEOUT - 1
    session.save()
    response = client.get("/")
    assert response.status_code == 302 and response["Location"].startswith("/accounts/login/")
    assert "_auth_user_id" not in client.session


def test_the_session_cookie_lasts_the_idle_timeout(client, operator, settings):
    assert settings.SESSION_IDLE_TIMEOUT == 8 * 3600
    client.force_login(operator)
    response = client.get("/")
    assert response.status_code == 200
    assert settings.SESSION_COOKIE_AGE == settings.SESSION_IDLE_TIMEOUT


def test_an_ipv6_subscriber_cannot_get_fresh_tries_by_changing_address(client, approver):
    for host in range(1, 6):
        _sign_in(client, "alice", "not-the-password", f"2001:db8:1:2::{host}")
    assert _sign_in(client, "alice", "pw-alice", "2001:db8:1:2::99").status_code == 429
    # another /64 is another place
    assert _sign_in(client, "alice", "pw-alice", "2001:db8:1:3::1").status_code == 302


def test_x_forwarded_for_does_not_change_where_a_sign_in_comes_from(client, approver):
    for n in range(5):
        client.post(
            "/accounts/login/",
            {"username": "alice", "password": "nope"},
            REMOTE_ADDR=HERE,
            HTTP_X_FORWARDED_FOR=f"10.9.9.{n}",
        )
    assert _sign_in(client, "alice", "pw-alice", HERE).status_code == 429

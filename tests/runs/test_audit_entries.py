"""Actions outside runs land in the chained audit log (issue 8): API tokens created and
revoked, users' roles and groups' permissions changed in the admin, sign-ins and failed
sign-ins — each with actor, channel, IP address, user agent and before/after values."""

from __future__ import annotations

from io import StringIO

import pytest
from django.contrib.auth.models import Group, Permission
from django.core.management import call_command

from runs.actors import Actor
from runs.audit.entries import audit_record
from runs.models import ApiToken, AuditEntry
from runs.tokens import api_token_create, api_token_revoke

pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("roles")]

BROWSER = "Mozilla/5.0 (X11; Linux x86_64) AuditTest/1.0"


def _only(action: str) -> AuditEntry:
    (entry,) = AuditEntry.objects.filter(action=action)
    return entry


@pytest.fixture
def superuser(django_user_model):
    return django_user_model.objects.create_superuser(
        username="root", password="pw-root", email="root@example.com"
    )


@pytest.fixture
def root_client(client, superuser):
    client.force_login(superuser)
    return client


def test_token_created_and_revoked_from_the_command_line(operator):
    call_command("create_api_token", "ci", "--principal", operator.username, stdout=StringIO())
    token = ApiToken.objects.get(name="ci")
    api_token_revoke(token_id=token.id, actor=Actor.system("cli"))

    created, revoked = _only("token.created"), _only("token.revoked")
    assert (created.actor, created.channel, created.object_type) == ("system", "cli", "api_token")
    assert created.object_id == str(token.id)
    assert created.after["name"] == "ci" and created.after["principal"] == operator.username
    assert created.after["revoked_at"] is None
    assert revoked.before["revoked_at"] is None and revoked.after["revoked_at"] is not None
    # nothing in the record could authenticate
    for entry in (created, revoked):
        assert token.token_hash not in str(entry.after) + str(entry.before)


def test_a_refused_revocation_writes_no_entry(operator):
    token, _raw = api_token_create(name="ci", principal=operator, actor=Actor.system("cli"))
    api_token_revoke(token_id=token.id, actor=Actor.system("cli"))
    from runs.services import InvalidState

    with pytest.raises(InvalidState):
        api_token_revoke(token_id=token.id, actor=Actor.system("cli"))
    assert AuditEntry.objects.filter(action="token.revoked").count() == 1


def test_token_created_and_revoked_in_the_admin_records_ip_and_user_agent(root_client, operator):
    root_client.post(
        "/admin/runs/apitoken/add/",
        {"name": "from-admin", "principal": operator.pk, "expires_at_0": "", "expires_at_1": ""},
        HTTP_USER_AGENT=BROWSER,
        REMOTE_ADDR="203.0.113.7",
    )
    token = ApiToken.objects.get(name="from-admin")
    root_client.post(
        "/admin/runs/apitoken/",
        {"action": "revoke_tokens", "_selected_action": [token.pk]},
        HTTP_USER_AGENT=BROWSER,
        REMOTE_ADDR="203.0.113.8",
    )

    created, revoked = _only("token.created"), _only("token.revoked")
    assert (created.actor, created.channel) == ("user:root", "admin")
    assert (created.ip_address, created.user_agent) == ("203.0.113.7", BROWSER)
    assert (revoked.actor, revoked.channel, revoked.ip_address) == (
        "user:root",
        "admin",
        "203.0.113.8",
    )


def test_a_forwarded_for_header_is_not_taken_as_the_address(operator):
    from django.test import RequestFactory

    request = RequestFactory().post(
        "/", REMOTE_ADDR="198.51.100.1", HTTP_X_FORWARDED_FOR="10.9.9.9"
    )
    entry = audit_record(action="x.test", actor="system", channel="cli", request=request)
    assert entry.ip_address == "198.51.100.1"


def test_audit_record_refuses_an_unknown_channel():
    with pytest.raises(ValueError, match="channel"):
        audit_record(action="x.test", actor="system", channel="telepathy")
    assert not AuditEntry.objects.exists()


def test_roles_changed_in_the_admin(root_client, viewer):
    operator_group = Group.objects.get(name="operator")
    response = root_client.post(
        f"/admin/auth/user/{viewer.pk}/change/",
        {
            "username": viewer.username,
            "first_name": "",
            "last_name": "",
            "email": "",
            "is_active": "on",
            "is_staff": "on",
            "groups": [operator_group.pk],
            "user_permissions": [],
            "last_login_0": "",
            "last_login_1": "",
            "date_joined_0": "2026-01-01",
            "date_joined_1": "00:00:00",
        },
        HTTP_USER_AGENT=BROWSER,
        REMOTE_ADDR="203.0.113.9",
    )
    assert response.status_code == 302, response.content

    entry = _only("user.roles_changed")
    assert (entry.actor, entry.channel, entry.object_type) == ("user:root", "admin", "user")
    assert entry.object_id == str(viewer.pk)
    assert entry.before["groups"] == ["viewer"] and entry.after["groups"] == ["operator"]
    assert (entry.before["is_staff"], entry.after["is_staff"]) == (False, True)
    assert (entry.ip_address, entry.user_agent) == ("203.0.113.9", BROWSER)


def test_an_edit_that_changes_no_role_is_not_recorded(root_client, viewer):
    root_client.post(
        f"/admin/auth/user/{viewer.pk}/change/",
        {
            "username": viewer.username,
            "first_name": "Victor",
            "last_name": "",
            "email": "victor@example.com",
            "is_active": "on",
            "groups": [Group.objects.get(name="viewer").pk],
            "user_permissions": [],
            "last_login_0": "",
            "last_login_1": "",
            "date_joined_0": "2026-01-01",
            "date_joined_1": "00:00:00",
        },
    )
    viewer.refresh_from_db()
    assert viewer.first_name == "Victor"
    assert not AuditEntry.objects.filter(action="user.roles_changed").exists()


def test_group_permissions_changed_in_the_admin(root_client):
    auditor = Group.objects.get(name="auditor")
    before = set(auditor.permissions.values_list("pk", flat=True))
    extra = Permission.objects.get(content_type__app_label="runs", codename="operate_run")
    response = root_client.post(
        f"/admin/auth/group/{auditor.pk}/change/",
        {"name": "auditor", "permissions": [*before, extra.pk]},
    )
    assert response.status_code == 302, response.content

    entry = _only("group.permissions_changed")
    assert "runs.operate_run" not in entry.before["permissions"]
    assert "runs.operate_run" in entry.after["permissions"]


def test_admin_sign_in_is_recorded_and_a_failed_one_only_counted(client, superuser):
    from axes.models import AccessAttempt

    client.post(
        "/admin/login/?next=/admin/",
        {"username": "root", "password": "wrong"},
        HTTP_USER_AGENT=BROWSER,
        REMOTE_ADDR="192.0.2.10",
    )
    response = client.post(
        "/admin/login/?next=/admin/",
        {"username": "root", "password": "pw-root"},
        HTTP_USER_AGENT=BROWSER,
        REMOTE_ADDR="192.0.2.11",
    )
    assert response.status_code == 302

    # a failure is counted by django-axes, per username and address, not audited (issue 17:
    # one audit row per failure under the log's global lock); lockouts are (test_sign_in.py)
    assert not AuditEntry.objects.filter(action="auth.sign_in_failed").exists()
    attempt = AccessAttempt.objects.get()
    assert (attempt.username, attempt.ip_address, attempt.failures_since_start) == (
        "root",
        "192.0.2.10",
        1,
    )
    signed_in = _only("auth.signed_in")
    assert (signed_in.actor, signed_in.channel) == ("user:root", "admin")
    assert (signed_in.ip_address, signed_in.user_agent) == ("192.0.2.11", BROWSER)
    call_command("audit_verify", stdout=StringIO())


def test_console_sign_in_is_recorded_with_the_web_channel(client, operator):
    client.post("/accounts/login/", {"username": operator.username, "password": "pw-olivia"})
    assert _only("auth.signed_in").channel == "web"


def test_password_changed_in_the_admin(root_client, viewer):
    response = root_client.post(
        f"/admin/auth/user/{viewer.pk}/password/",
        {"password1": "a-new-long-password", "password2": "a-new-long-password"},
    )
    assert response.status_code == 302
    entry = _only("user.password_changed")
    assert (entry.actor, entry.object_id) == ("user:root", str(viewer.pk))
    assert "a-new-long-password" not in str(entry.after) + str(entry.before)


def test_a_refused_password_change_is_not_recorded(root_client, viewer):
    root_client.post(
        f"/admin/auth/user/{viewer.pk}/password/",
        {"password1": "a-new-long-password", "password2": "something-else"},
    )
    assert not AuditEntry.objects.filter(action="user.password_changed").exists()


def test_email_changed_in_the_admin(root_client, approver):
    response = root_client.post(
        f"/admin/auth/user/{approver.pk}/change/",
        {
            "username": approver.username,
            "email": "attacker@example.com",
            "is_active": "on",
            "groups": [Group.objects.get(name="approver").pk],
            "date_joined_0": "2026-01-01",
            "date_joined_1": "00:00:00",
        },
    )
    assert response.status_code == 302, response.content
    entry = _only("user.email_changed")
    assert (entry.actor, entry.channel, entry.object_id) == ("user:root", "admin", str(approver.pk))
    assert entry.before["email"] == "" and entry.after["email"] == "attacker@example.com"
    # roles did not change: no roles entry
    assert not AuditEntry.objects.filter(action="user.roles_changed").exists()

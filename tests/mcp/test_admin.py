"""The gateway's rows in the admin: auditors read them, nobody changes them, and the
arguments a client sent (unmasked on these rows) are not shown."""

from __future__ import annotations

import pytest
from django.contrib import admin
from django.contrib.auth.models import Group
from django.test import RequestFactory
from django.urls import reverse

from agentops.mcp import services
from agentops.mcp.models import GatewayCall, GatewaySession
from runs.actors import Actor
from runs.tokens import api_token_create
from tests.conftest import drive

pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("roles")]

SECRET_ORDER = {"order_id": "ord_80808080808"}  # no timestamp or id contains it


@pytest.fixture
def recorded(robot, sandbox):
    token, _ = api_token_create(name="mcp", principal=robot, actor=Actor.system("cli"))
    call = services.gateway_call_record(
        token=token,
        tool_name="lookup_order",
        arguments=SECRET_ORDER,
        client_key="k-1",
        session="s",
    )
    drive(call.run_id)
    return call


@pytest.fixture
def auditor_client(client, django_user_model):
    auditor = django_user_model.objects.create_user("audrey", password="pw", is_staff=True)
    auditor.groups.add(Group.objects.get(name="auditor"))
    client.force_login(auditor)
    return client


def test_auditors_read_the_gateways_sessions_and_calls(auditor_client, recorded):
    session = GatewaySession.objects.get()
    for obj in (session, recorded):
        opts = obj._meta
        listing = auditor_client.get(reverse(f"admin:mcp_{opts.model_name}_changelist"))
        assert listing.status_code == 200
        assert b"addlink" not in listing.content
        page = auditor_client.get(reverse(f"admin:mcp_{opts.model_name}_change", args=[obj.pk]))
        assert page.status_code == 200
        assert str(recorded.run_id).encode() in page.content
        assert SECRET_ORDER["order_id"].encode() not in page.content
        assert SECRET_ORDER["order_id"].encode() not in listing.content
    assert (
        b"k-1"
        in auditor_client.get(reverse("admin:mcp_gatewaycall_changelist"), {"q": "k-1"}).content
    )


@pytest.mark.parametrize("role", ["auditor", "admin", "operator", "superuser"])
def test_nobody_adds_changes_or_deletes_them(django_user_model, role):
    if role == "superuser":
        user = django_user_model.objects.create_superuser("root", password="pw")
    else:
        user = django_user_model.objects.create_user("u", password="pw", is_staff=True)
        user.groups.add(Group.objects.get(name=role))
    request = RequestFactory().get("/admin/")
    request.user = user
    for model in (GatewaySession, GatewayCall):
        model_admin = admin.site._registry[model]
        assert not model_admin.has_add_permission(request)
        assert not model_admin.has_change_permission(request)
        assert not model_admin.has_delete_permission(request)

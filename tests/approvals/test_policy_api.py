"""The approval policy API and admin (issue 23, item 4): automation drafts, simulates and
publishes through the same services as the console; auditors read policies in the admin."""

from __future__ import annotations

import pytest
from django.urls import reverse
from rest_framework.test import APIClient

from approvals.models import ApprovalPolicyVersion
from tests.api.conftest import token_for
from tests.approvals.test_policies import TWO_ABOVE_50, draft
from tests.conftest import _user_in

pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("roles")]


@pytest.fixture
def ada(django_user_model):
    return _user_in(django_user_model, "ada", "admin")


@pytest.fixture
def bea(django_user_model):
    return _user_in(django_user_model, "bea", "admin")


_names = iter(range(10**6))


def client_for(user) -> APIClient:
    client = APIClient()
    client.credentials(
        HTTP_AUTHORIZATION=f"Bearer {token_for(user, f'{user.username}-{next(_names)}')}"
    )
    return client


BODY = {"tool": "refund_payment", "rules": TWO_ABOVE_50, "note": "above 50.00 needs two"}


def test_draft_simulate_and_publish_over_the_api(ada, bea):
    response = client_for(ada).post("/api/v1/policies/", BODY, format="json")
    assert response.status_code == 201, response.json()
    version = response.json()
    assert (version["number"], version["status"], version["created_by"]) == (1, "draft", "ada")
    simulated = client_for(ada).post(
        f"/api/v1/policy-versions/{version['id']}/simulation/", {"days": 3}, format="json"
    )
    assert simulated.status_code == 200 and "counts" in simulated.json()
    refused = client_for(ada).post(f"/api/v1/policy-versions/{version['id']}/publication/")
    assert refused.status_code == 403 and refused.json()["code"] == "permission_denied"
    published = client_for(bea).post(f"/api/v1/policy-versions/{version['id']}/publication/")
    assert published.status_code == 200
    assert published.json()["version"]["status"] == "published"
    listed = client_for(bea).get("/api/v1/policies/").json()
    assert listed[0]["versions"][0]["published_by"] == "bea"
    again = client_for(bea).post(f"/api/v1/policy-versions/{version['id']}/publication/")
    assert again.status_code == 409 and again.json()["code"] == "invalid_state"


def test_invalid_rules_are_a_validation_error_with_fields_by_rule(ada):
    body = {**BODY, "rules": [{"when": "args.amount > 1", "decide": "deny"}]}
    response = client_for(ada).post("/api/v1/policies/", body, format="json")
    assert response.status_code == 400
    data = response.json()
    assert data["code"] == "validation_error"
    assert "args has no field 'amount'" in data["fields"]["rule 1"][0]
    assert not ApprovalPolicyVersion.objects.exists()


def test_rules_can_be_simulated_without_a_draft(ada):
    response = client_for(ada).post(
        "/api/v1/policies/simulations/",
        {"tool": "refund_payment", "rules": [{"decide": "deny"}], "days": 2},
        format="json",
    )
    assert response.status_code == 200
    assert response.json()["compared_with"] == "the code policy"
    assert not ApprovalPolicyVersion.objects.exists()


def test_operators_cannot_draft_or_read_policies(operator):
    assert client_for(operator).get("/api/v1/policies/").status_code == 403
    assert client_for(operator).post("/api/v1/policies/", BODY, format="json").status_code == 403


def test_auditors_read_policy_versions_in_the_admin_and_change_nothing(
    client, django_user_model, ada
):
    auditor = _user_in(django_user_model, "audrey", "auditor")
    auditor.is_staff = True
    auditor.save(update_fields=["is_staff"])
    version = draft(ada)
    client.force_login(auditor)
    page = client.get(reverse("admin:approvals_approvalpolicyversion_change", args=[version.id]))
    assert page.status_code == 200
    assert "args.amount_cents &gt; 5000" in page.content.decode()
    assert client.get(reverse("admin:approvals_approvalpolicy_changelist")).status_code == 200
    client.post(
        reverse("admin:approvals_approvalpolicyversion_change", args=[version.id]),
        {"note": "edited"},
    )
    version.refresh_from_db()
    assert version.note == "above 50.00 needs two"

"""Agents over the API: the list (hosted and remote), one agent, and remote manifests
registered by admins (validated and audited)."""

from __future__ import annotations

import copy

import pytest
from django.contrib.auth.models import Group

from runs.models import AgentManifest, AuditEntry, Run
from tests.api.conftest import assert_error, client_for
from tests.api.remote_support import MANIFEST, register_remote

pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("roles")]


@pytest.fixture
def admin(django_user_model):
    user = django_user_model.objects.create_user("ada", password="x")
    user.groups.add(Group.objects.get(name="admin"))
    return user


@pytest.fixture
def as_admin(admin):
    return client_for(admin)


def test_list_shows_hosted_and_remote_agents(as_operator, api_agents, admin):
    register_remote(admin)

    agents = {agent["name"]: agent for agent in as_operator.get("/api/v1/agents/").json()}

    assert agents["api_payer"]["kind"] == "hosted"
    remote = agents["pay_bot"]
    assert remote["kind"] == "remote" and remote["version"] == "1"
    tools = {tool["name"]: tool for tool in remote["tools"]}
    assert set(tools) == {"refund", "notify", "lookup", "charge"}
    assert tools["refund"]["effect"] == "reconcilable"
    assert tools["refund"]["sensitive_fields"] == ["card"]
    assert tools["refund"]["approval"]["when"] == "amount_cents gt 10000"


def test_detail_of_hosted_remote_and_missing(as_operator, api_agents, admin):
    register_remote(admin)
    assert as_operator.get("/api/v1/agents/api_payer/").json()["kind"] == "hosted"
    assert as_operator.get("/api/v1/agents/pay_bot/").json()["kind"] == "remote"
    assert_error(as_operator.get("/api/v1/agents/nobody/"), 404, "not_found")


def test_put_registers_then_updates_and_is_audited(as_admin):
    created = as_admin.put("/api/v1/agents/pay_bot/", MANIFEST)
    assert created.status_code == 201, created.content
    assert created.json()["kind"] == "remote"

    manifest = copy.deepcopy(MANIFEST)
    manifest["version"] = "2"
    manifest["migrations"] = {"1": {"to": "2", "description": "adds totals"}}
    updated = as_admin.put("/api/v1/agents/pay_bot/", manifest)
    assert updated.status_code == 200
    assert AgentManifest.objects.get(name="pay_bot").version == "2"

    entries = list(AuditEntry.objects.filter(object_id="pay_bot").order_by("id"))
    assert [e.action for e in entries] == ["agent.registered", "agent.updated"]
    assert entries[1].before["version"] == "1" and entries[1].after["version"] == "2"
    assert entries[1].actor == "token:token-ada" and entries[1].channel == "api"


def test_the_owner_and_question_groups_are_an_admins_audited_grant(as_admin, robot, as_robot):
    """Who drives the agent, and whom its runs may ask, are named by an admin; the change is
    in the audit log; the agent itself cannot change them (nor anything of its manifest)."""
    manifest = {**MANIFEST, "owner": "robby", "question_groups": ["operator"]}
    assert as_admin.put("/api/v1/agents/pay_bot/", manifest, format="json").status_code == 201
    stored = AgentManifest.objects.get(name="pay_bot")
    assert (stored.owner, stored.question_groups) == (robot, ["operator"])

    wider = {**manifest, "owner": "robby", "question_groups": ["operator", "approver"]}
    refused = as_robot.put("/api/v1/agents/pay_bot/", wider, format="json")
    assert_error(refused, 403, "permission_denied")
    assert AgentManifest.objects.get(name="pay_bot").question_groups == ["operator"]

    # an update that leaves the owner out keeps it; null removes it
    narrower = {**MANIFEST, "question_groups": []}
    assert as_admin.put("/api/v1/agents/pay_bot/", narrower, format="json").status_code == 200
    assert AgentManifest.objects.get(name="pay_bot").owner == robot
    cleared = {**MANIFEST, "owner": None}
    assert as_admin.put("/api/v1/agents/pay_bot/", cleared, format="json").status_code == 200
    assert AgentManifest.objects.get(name="pay_bot").owner is None

    entries = list(AuditEntry.objects.filter(object_id="pay_bot").order_by("id"))
    assert [e.action for e in entries] == ["agent.registered", "agent.updated", "agent.updated"]
    assert entries[0].after["owner"] == "robby"
    assert entries[1].after["question_groups"] == [] and entries[1].after["owner"] == "robby"
    assert entries[2].before["owner"] == "robby" and entries[2].after["owner"] is None


def test_put_is_for_admins_only(as_operator, anonymous):
    assert_error(as_operator.put("/api/v1/agents/pay_bot/", MANIFEST), 403, "permission_denied")
    assert_error(anonymous.put("/api/v1/agents/pay_bot/", MANIFEST), 401, "not_authenticated")
    assert not AgentManifest.objects.exists()


@pytest.mark.parametrize(
    ("change", "field"),
    [
        (lambda m: m.pop("version"), "version"),
        (lambda m: m.update(input_schema={"type": "nonsense"}), "input_schema"),
        (lambda m: m["tools"][0].update(effect="magic"), "tools.0"),
        (lambda m: m["tools"][0].update(argument_schema={"type": 5}), "tools.0"),
        (lambda m: m["tools"][0]["approval"].update(when="sometimes"), "tools.0"),
        (lambda m: m["tools"][0]["approval"].update(group="nobody"), "tools.0"),
        (lambda m: m["tools"][0]["approval"].update(when={"argument": "a", "op": "~"}), "tools.0"),
        (lambda m: m["tools"][1].update(name="refund"), "tools.1"),
        (lambda m: m["tools"][1].update(name="a/b"), "tools.1"),
        (lambda m: m.update(migrations={"1": "2"}), "migrations"),
        (lambda m: m.update(extra=True), "non_field_errors"),
        (lambda m: m.update(owner="nobody"), "owner"),
        (lambda m: m.update(owner=7), "owner"),
        (lambda m: m.update(question_groups=["nobody"]), "question_groups"),
        (lambda m: m.update(question_groups="operator"), "question_groups"),
    ],
)
def test_put_validates_the_manifest(as_admin, change, field):
    manifest = copy.deepcopy(MANIFEST)
    change(manifest)
    response = as_admin.put("/api/v1/agents/pay_bot/", manifest, format="json")
    assert field in assert_error(response, 400, "validation_error")["fields"]
    assert not AgentManifest.objects.exists()


def test_put_cannot_replace_a_hosted_agent(as_admin, api_agents):
    assert_error(as_admin.put("/api/v1/agents/api_payer/", MANIFEST), 409, "invalid_state")


def test_runs_of_a_remote_agent_are_created_and_checked_against_its_input_schema(
    as_operator, admin
):
    register_remote(admin)
    created = as_operator.post("/api/v1/runs/", {"agent": "pay_bot", "input": {"order_id": "o"}})
    assert created.status_code == 201, created.content
    assert Run.objects.get(id=created.json()["id"]).agent_version == "1"

    bad = as_operator.post("/api/v1/runs/", {"agent": "pay_bot", "input": {}})
    assert_error(bad, 400, "validation_error")


def test_new_version_with_a_migration_hop_takes_over_older_runs(
    as_operator, admin, as_admin, robot, as_robot
):
    register_remote(admin, owner=robot)
    run_id = as_operator.post(
        "/api/v1/runs/", {"agent": "pay_bot", "input": {"order_id": "o"}}
    ).json()["id"]
    manifest = copy.deepcopy(MANIFEST)
    manifest["version"] = "2"
    manifest["migrations"] = {"1": {"to": "2", "description": "adds totals"}}
    as_admin.put("/api/v1/agents/pay_bot/", manifest)

    lease = as_robot.post(f"/api/v1/runs/{run_id}/lease/").json()

    assert lease["resume"]["agent_version"] == "2"
    assert lease["resume"]["migrated_from"] == "1"
    assert lease["resume"]["migrations"] == [{"from": "1", "to": "2", "description": "adds totals"}]


def test_new_version_without_a_hop_parks_older_runs(as_operator, admin, as_admin, robot, as_robot):
    register_remote(admin, owner=robot)
    run_id = as_operator.post(
        "/api/v1/runs/", {"agent": "pay_bot", "input": {"order_id": "o"}}
    ).json()["id"]
    as_admin.put("/api/v1/agents/pay_bot/", {**MANIFEST, "version": "3"})

    assert_error(as_robot.post(f"/api/v1/runs/{run_id}/lease/"), 409, "invalid_state")
    run = Run.objects.get(id=run_id)
    assert (run.status, run.reason_code) == ("needs_attention", "incompatible_agent_version")

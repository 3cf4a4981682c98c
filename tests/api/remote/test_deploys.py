"""A remote agent's manifest changed while a run was parked (a deploy of the agent process):
what settled stays settled, and a manifest tool's fingerprint is its declaration."""

from __future__ import annotations

import copy

import pytest

from runs.models import Run, Step, ToolCall
from runs.registry import registry
from runs.remote.manifest import manifest_tool
from tests.api.conftest import client_for
from tests.api.remote_support import MANIFEST, Agent, register_remote
from tests.support import event_types, expire_lease

pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("roles")]


def _deploy(admin, **tool_changes) -> None:
    """Version 2 of the manifest, with a migration hop, and every tool's schema changed."""
    manifest = copy.deepcopy(MANIFEST)
    manifest["version"] = "2"
    manifest["migrations"] = {"1": {"to": "2"}}
    for spec in manifest["tools"]:
        spec["version"] = "2"
        spec.update(tool_changes.get(spec["name"], {}))
    register_remote(admin, manifest=manifest)


def test_a_rejection_reaches_the_process_with_its_comment_after_the_manifest_changed(
    run, leased, as_approver, admin
):
    proposed = leased.propose("refund", {"order_id": "o", "amount_cents": 20000}).json()
    before = ToolCall.objects.get(id=proposed["tool_call"]["id"]).tool_version
    as_approver.post(
        f"/api/v1/approvals/{proposed['approval']}/decision/",
        {"decision": "reject", "comment": "not this month"},
    )
    _deploy(admin)
    assert registry.tool("pay_bot/refund").version != before

    assert leased.lease().status_code == 200

    assert leased.resume["open_tool_calls"] == []
    last = leased.resume["steps"][-1]
    assert (last["status"], last["error"]) == ("failed", "approval rejected: not this month")
    assert "tool.cancelled" not in event_types(run.id)


def test_an_unsafe_call_resolved_as_happened_completes_after_the_manifest_changed(
    robot, run, leased, operator, admin
):
    from tests.api.remote.test_protocol import client_for_second

    call = leased.propose("notify", {}).json()["tool_call"]
    leased.dispatch(call["id"])
    expire_lease(run.id)
    second = Agent(client_for_second(robot), run.id)
    second.lease()  # needs_attention: unknown_outcome
    _deploy(admin, notify={"argument_schema": {"type": "object", "properties": {}}})
    resolved = client_for(operator).post(
        f"/api/v1/tool-calls/{call['id']}/resolution/",
        {"outcome": "happened", "external_ref": "msg-1"},
    )
    assert resolved.status_code == 200, resolved.content
    # the agent changed version: the step waits for the migrated run to complete it
    assert Step.objects.get(run=run, seq=1).status == Step.Status.PENDING

    assert second.lease().status_code == 200, second.resume

    assert second.resume["unknown_outcomes"] == []
    assert second.resume["steps"][-1]["status"] == "completed"
    assert ToolCall.objects.get(id=call["id"]).status == ToolCall.Status.SUCCEEDED
    run.refresh_from_db()
    assert (run.status, run.reason_code) == (Run.Status.RUNNING, "")
    assert "tool.cancelled" not in event_types(run.id)


def test_a_manifest_tools_fingerprint_is_its_declaration():
    spec = copy.deepcopy(MANIFEST["tools"][0])
    base = manifest_tool("pay_bot", spec).version

    assert manifest_tool("pay_bot", copy.deepcopy(spec)).version == base
    changes = [
        {"version": "2"},
        {"effect": "unsafe"},
        {"argument_schema": {"type": "object"}},
        {"sensitive_fields": []},
        {"precondition": True},
        {"approval": {**spec["approval"], "when": {**spec["approval"]["when"], "value": 20000}}},
        {"approval": {**spec["approval"], "required": 2}},
        {"approval": {**spec["approval"], "group": "operator"}},
        {"approval": {**spec["approval"], "ttl_seconds": 600}},
    ]
    versions = {manifest_tool("pay_bot", {**spec, **change}).version for change in changes}
    assert base not in versions and len(versions) == len(changes)
    # what agentops does not run (the process calls the tool) does not count
    assert manifest_tool("pay_bot", {**spec, "timeout": 30}).version == base

"""A remote agent's run state updated by a JSON Patch (RFC 6902, issue 27): under the lease, all
operations or none, with a precondition on the state's version or the patch's own ``test``
ops, a clear code for a patch that does not apply, and the JSON rule of every input."""

from __future__ import annotations

import pytest
from django.conf import settings

from runs.models import Run, RunEvent
from tests.api.conftest import assert_error
from tests.support import expire_lease

pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("roles")]


def _patch(agent, patch, **extra):
    body = {"fence": agent.fence, "lease_token": agent.lease_token, "patch": patch, **extra}
    return agent.client.post(f"/api/v1/runs/{agent.run_id}/state/", body, format="json")


def _state(run: Run) -> tuple[dict, int]:
    stored = Run.objects.get(id=run.id)
    return stored.state, stored.state_version


@pytest.fixture
def with_state(run, leased):
    step = leased.run_post("steps", {"state": {"messages": ["hi"], "plan": {"step": 1}}})
    assert step.status_code == 201, step.content
    return _state(run)[1]


def test_a_patch_updates_the_state_and_its_version(run, leased, with_state):
    answer = _patch(
        leased,
        [
            {"op": "add", "path": "/messages/-", "value": "hello"},
            {"op": "replace", "path": "/plan/step", "value": 2},
            {"op": "copy", "from": "/plan", "path": "/previous_plan"},
            {"op": "remove", "path": "/previous_plan/step"},
        ],
        state_version=with_state,
    )

    assert answer.status_code == 200, answer.content
    expected = {"messages": ["hi", "hello"], "plan": {"step": 2}, "previous_plan": {}}
    assert answer.json() == {"state": expected, "state_version": with_state + 1}
    assert _state(run) == (expected, with_state + 1)
    event = RunEvent.objects.filter(run_id=run.id, type="run.state_patched").get()
    assert event.payload["operation_count"] == 4
    assert event.payload["operations"][0] == {"op": "add", "path": "/messages/-"}
    assert event.actor.startswith("token:")


def test_a_failed_test_op_changes_nothing(run, leased, with_state):
    before = _state(run)

    answer = _patch(
        leased,
        [
            {"op": "add", "path": "/messages/-", "value": "x"},
            {"op": "test", "path": "/plan/step", "value": 7},
        ],
    )

    body = assert_error(answer, 409, "patch_test_failed")
    assert body["state_version"] == with_state
    assert _state(run) == before


def test_a_stale_state_version_changes_nothing(run, leased, with_state):
    before = _state(run)

    answer = _patch(leased, [{"op": "add", "path": "/x", "value": 1}], state_version=with_state - 1)

    body = assert_error(answer, 409, "state_version_mismatch")
    assert body["state_version"] == with_state
    assert _state(run) == before


@pytest.mark.parametrize(
    "patch",
    [
        [{"op": "remove", "path": "/nothing_here"}],
        [{"op": "replace", "path": "/messages/5", "value": 1}],
        [{"op": "add", "path": "/missing/deeper", "value": 1}],
        [{"op": "move", "from": "/nope", "path": "/x"}],
        [{"op": "replace", "path": "", "value": [1, 2]}],
    ],
    ids=["remove-missing", "index-out-of-range", "missing-parent", "move-missing", "not-object"],
)
def test_a_patch_that_does_not_apply_is_a_conflict(run, leased, with_state, patch):
    before = _state(run)

    assert_error(_patch(leased, patch), 409, "patch_not_applicable")
    assert _state(run) == before


@pytest.mark.parametrize(
    "patch",
    [
        [{"op": "frobnicate", "path": "/x"}],
        [{"path": "/x", "value": 1}],
        [{"op": "add", "path": "/x"}],
        [{"op": "add", "path": "no-slash", "value": 1}],
        [{"op": "move", "path": "/x"}],
        [],
        "not a list",
        [["add", "/x", 1]],
    ],
    ids=["bad-op", "no-op", "no-value", "bad-pointer", "move-no-from", "empty", "string", "list"],
)
def test_a_malformed_patch_is_a_400(run, leased, with_state, patch):
    before = _state(run)

    answer = _patch(leased, patch)

    assert answer.status_code == 400, answer.content
    assert answer.json()["code"] in ("validation_error", "invalid_patch")
    assert _state(run) == before


def test_the_patched_state_obeys_the_json_rule(run, leased, with_state, monkeypatch):
    monkeypatch.setitem(settings.AGENTOPS, "JSON_MAX_BYTES", 4096)
    before = _state(run)
    big = {"op": "add", "path": "/blob", "value": {"text": "x" * 1000}}
    # each copy doubles /blob: past the limit long before the last one (2**40 KB)
    doubling = [{"op": "copy", "from": "/blob", "path": f"/blob/c{i}"} for i in range(40)]

    assert_error(_patch(leased, [big, *doubling]), 400, "json_too_large")
    assert_error(_patch(leased, [{"op": "add", "path": "/n", "value": "a\x00b"}]), 400, "nul_byte")
    assert _state(run) == before


def test_a_patch_needs_the_lease(run, leased, with_state):
    add = [{"op": "add", "path": "/x", "value": 1}]
    expire_lease(run.id)

    assert_error(_patch(leased, add), 409, "lease_lost")

    assert leased.lease().status_code == 200
    leased.lease_token = "not-the-token"
    assert_error(_patch(leased, add), 403, "lease_not_yours")
    assert "x" not in _state(run)[0]

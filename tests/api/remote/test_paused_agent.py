"""Issue 15, "remote agent, paused after dispatch": the demo remote agent (agentops.client) as
a real process, frozen with SIGSTOP by ``AGENTOPS_PAUSE_AT`` right after its dispatch answer
or right after its pre-send check; its lease expires, a second process takes over, looks the
key up after the landing deadline and refunds. The first, resumed, never sends: one refund in
the sandbox's own ledger, one POST in its request log."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
from django.conf import settings

from agentops.demo.remote_agent import MANIFEST, NAME
from runs.actors import Actor
from runs.models import Run, ToolCall
from runs.remote import agent_manifest_put
from runs.services import run_create
from tests.agentproc import ROOT
from tests.api.conftest import token_for
from tests.api.test_remote_agent_e2e import AgentProcess
from tests.support import expire_lease, refund_posts, refunds, rewind

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("roles")]


@pytest.fixture
def agent_token(robot, django_user_model):
    admin = django_user_model.objects.create_superuser("root", password="x")
    manifest = {**MANIFEST, "owner": robot.username}
    agent_manifest_put(name=NAME, manifest=manifest, actor=Actor.for_user(admin, "cli"))
    return token_for(robot, "refunder")


def _stopped(proc: subprocess.Popen, timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with open(f"/proc/{proc.pid}/stat") as stat:
            if stat.read().rsplit(")", 1)[1].split()[0] == "T":
                return
        time.sleep(0.02)
    raise AssertionError("the agent did not freeze")


@pytest.mark.parametrize("point", ["dispatching", "before_send"])
def test_paused_agent_never_sends_after_another_took_over(
    point, live_server, sandbox, agent_token, operator, monkeypatch
):
    # a short send window: a process frozen longer than that may no longer send (the live
    # server runs in this process and reads the settings at each dispatch)
    monkeypatch.setitem(settings.AGENTOPS, "SEND_WINDOW", 0.5)
    run = run_create(
        agent_name=NAME,
        input={"order_id": "ord_1002", "amount_cents": 1500},
        actor=Actor.for_user(operator, "api"),
    )
    common = ["--run", str(run.id), "--url", live_server.url, "--sandbox", sandbox.url]
    os.environ["AGENTOPS_PAUSE_AT"] = point
    try:
        first = AgentProcess(*common, "--owner", "first", token=agent_token)
    finally:
        del os.environ["AGENTOPS_PAUSE_AT"]
    try:
        first.wait_for(f"AGENTOPS_PAUSE_AT: freezing process {first.proc.pid} at {point}")
        _stopped(first.proc)
        call = ToolCall.objects.get(run=run)
        assert call.status == ToolCall.Status.DISPATCHING and call.attempt_count == 1
        # frozen past its lease and the landing window (moved into the past, not slept)
        expire_lease(run.id)
        rewind(run.id)

        second = AgentProcess(*common, "--owner", "second", token=agent_token)
        assert second.finish() == 0, second.seen
        assert second.seen[-1] == "finished"
        assert len(refunds(sandbox)) == 1

        os.killpg(first.proc.pid, signal.SIGCONT)
        code = first.finish(timeout=30)
    finally:
        if first.proc.poll() is None:
            first.kill()
    assert code == 3, first.seen  # lease lost: it stopped, and sent nothing
    assert not any(line.startswith("tool returned") for line in first.seen), first.seen
    # at before_send the server had cleared it: the tool was entered, and its own check of
    # the send budget (counted on this host from before the dispatch) refused to send
    entered = any(line.startswith("dispatching") for line in first.seen)
    assert entered == (point == "before_send"), first.seen
    # the downstream's own record: one refund, and one request ever received
    assert len(refunds(sandbox)) == 1
    assert len(refund_posts(sandbox)) == 1
    run.refresh_from_db()
    assert run.status == Run.Status.SUCCEEDED
    call.refresh_from_db()
    assert (call.status, call.attempt_count) == (ToolCall.Status.SUCCEEDED, 2)


def test_malformed_pause_spec_is_one_line_and_a_nonzero_exit():
    env = {**os.environ, "AGENTOPS_TOKEN": "x", "AGENTOPS_PAUSE_AT": "before_sned"}
    env.pop("DJANGO_SETTINGS_MODULE", None)
    done = subprocess.run(
        [sys.executable, "-m", "agentops.demo.remote_agent", "--run", "r"],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=30,
    )
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        "AGENTOPS_PAUSE_AT='before_sned': unknown boundary 'before_sned' (expected one of "
        "claimed, decided, approval_requested, dispatching, before_send, tool_call, "
        "receipt_recorded, step_completed, run_finished, optionally followed by :N)"
    ]

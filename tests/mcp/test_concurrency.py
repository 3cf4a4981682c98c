"""Two first calls of one session at the same moment (two gateway processes, or a client
that sent twice): one run, one recorded call, whichever request commits first."""

from __future__ import annotations

import threading

import pytest

from agentops.mcp import services
from agentops.mcp.gateway import AGENT_NAME
from agentops.mcp.models import GatewayCall, GatewaySession
from runs.actors import Actor
from runs.models import Run
from runs.tokens import api_token_create
from tests.support import close_connection

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("roles")]


@pytest.mark.parametrize("client_key", ["", "same-key"])
def test_simultaneous_first_calls_share_one_run_and_one_call(robot, client_key):
    token, _ = api_token_create(name="mcp", principal=robot, actor=Actor.system("cli"))
    start = threading.Barrier(4)
    recorded: list[int] = []
    errors: list[BaseException] = []

    def first_call() -> None:
        try:
            start.wait()
            call = services.gateway_call_record(
                token=token,
                tool_name="lookup_order",
                arguments={"order_id": "ord_1004"},
                client_key=client_key,
                session="s",
            )
            recorded.append(call.id)
        except BaseException as exc:
            errors.append(exc)
        finally:
            close_connection()

    threads = [threading.Thread(target=first_call) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert errors == []
    assert len(recorded) == 4 and len(set(recorded)) == 1
    assert Run.objects.filter(agent_name=AGENT_NAME).count() == 1
    assert GatewaySession.objects.count() == 1
    assert GatewayCall.objects.count() == 1

"""The refund tool and its lookup by key, as the framework agents of these tests write them:
plain functions that reach the sandbox payments service. Imports no Django (the agents run
as their own processes, as a user's would).

``HOLD_AFTER_TOOL=1``: after the refund went through, print so and hang before anything is
recorded — the test SIGKILLs the process there."""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from typing import Any

import httpx

from agentops.client import Found, OutcomeUnknown, ToolFailed
from agentops.client.routing import current_call

SANDBOX = os.environ.get("SANDBOX_URL", "http://127.0.0.1:8765").rstrip("/")


def say(message: str) -> None:
    print(message, flush=True)


def refund(order_id: str, amount_cents: int) -> dict[str, Any]:
    call = current_call()  # the idempotency key; a request never sent after the deadline
    say(f"dispatching {call.idempotency_key} attempt {call.attempt}")
    body = {"idempotency_key": call.idempotency_key, "order_id": order_id}
    response = call.request(
        "POST", f"{SANDBOX}/refunds", json={**body, "amount_cents": amount_cents}
    )
    say(f"tool returned {response.status_code}")
    if os.environ.get("HOLD_AFTER_TOOL"):
        while True:  # the refund happened, nothing is recorded: the test kills us here
            time.sleep(60)
    if response.status_code >= 500:
        raise OutcomeUnknown(f"answered {response.status_code}")
    if response.status_code >= 400:
        raise ToolFailed(response.json())
    return response.json()


def find_refund(key: str, arguments: Mapping[str, Any]) -> Found:
    try:
        response = httpx.get(f"{SANDBOX}/refunds", params={"idempotency_key": key}, timeout=5)
        body = response.json()
    except (httpx.HTTPError, ValueError) as exc:
        return Found("unknown", detail=str(exc))  # a failed lookup is not absence
    if response.status_code == 200 and body.get("found") is True:
        say(f"reconciled {key}: found")
        return Found("found", body["refunds"][0], body["refunds"][0].get("refund_id", ""))
    if response.status_code == 200 and body.get("found") is False:
        return Found("absent")
    return Found("unknown", detail=str(body))

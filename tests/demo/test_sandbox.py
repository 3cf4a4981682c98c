"""Tests for the sandbox payments service (agentops.demo.sandbox).

Each server runs as a real subprocess on a free port with its own SQLite file; the
tests talk to it over HTTP with httpx.  No Django is involved.
"""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest

from agentops.demo.sandbox import REPO_ROOT, SandboxProcess, free_port, start_sandbox


def _client(sandbox: SandboxProcess) -> httpx.Client:
    return httpx.Client(base_url=sandbox.url, timeout=5.0)


@pytest.fixture(scope="module")
def dedupe_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SandboxProcess]:
    db = tmp_path_factory.mktemp("sandbox-dedupe") / "sandbox.sqlite3"
    with start_sandbox(str(db), mode="dedupe", port=free_port()) as sandbox:
        yield sandbox


@pytest.fixture(scope="module")
def nodedupe_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SandboxProcess]:
    db = tmp_path_factory.mktemp("sandbox-nodedupe") / "sandbox.sqlite3"
    with start_sandbox(str(db), mode="nodedupe", port=free_port()) as sandbox:
        yield sandbox


@pytest.fixture
def dedupe(dedupe_server: SandboxProcess) -> Iterator[httpx.Client]:
    with _client(dedupe_server) as client:
        assert client.post("/reset").status_code == 200
        # a test may have switched it at runtime (POST /mode)
        assert client.post("/mode", json={"dedupe": True, "deadline": False}).status_code == 200
        yield client


@pytest.fixture
def nodedupe(nodedupe_server: SandboxProcess) -> Iterator[httpx.Client]:
    with _client(nodedupe_server) as client:
        assert client.post("/reset").status_code == 200
        assert client.post("/mode", json={"dedupe": False, "deadline": False}).status_code == 200
        yield client


def refund(
    client: httpx.Client,
    key: str,
    order_id: str = "ord_1003",
    amount_cents: int = 1000,
    fault: str | None = None,
) -> httpx.Response:
    headers = {"X-Sandbox-Fault": fault} if fault else {}
    body = {"idempotency_key": key, "order_id": order_id, "amount_cents": amount_cents}
    return client.post("/refunds", json=body, headers=headers)


def lookup(client: httpx.Client, key: str, fault: str | None = None) -> httpx.Response:
    headers = {"X-Sandbox-Fault": fault} if fault else {}
    return client.get("/refunds", params={"idempotency_key": key}, headers=headers)


def rows_for(client: httpx.Client, key: str) -> list[dict[str, Any]]:
    refunds = client.get("/refunds/all").json()["refunds"]
    return [r for r in refunds if r["idempotency_key"] == key]


def log_for(client: httpx.Client, key: str) -> list[dict[str, Any]]:
    return client.get("/requests", params={"idempotency_key": key}).json()["requests"]


# -- basics ----------------------------------------------------------------


def test_health_and_seeded_orders(dedupe: httpx.Client) -> None:
    assert dedupe.get("/health").json() == {
        "ok": True,
        "mode": "dedupe",
        "dedupe": True,
        "deadline": False,
    }

    resp = dedupe.get("/orders/ord_1004")
    assert resp.status_code == 200
    assert resp.headers["content-type"] == "application/json"
    assert resp.json() == {
        "order_id": "ord_1004",
        "customer": "dave@example.com",
        "amount_cents": 250000,
        "currency": "EUR",
        "status": "paid",
        "refunded_cents": 0,
    }
    orders = dedupe.get("/orders").json()["orders"]
    assert [o["order_id"] for o in orders] == [f"ord_{n}" for n in range(1001, 1011)]
    assert len({o["amount_cents"] for o in orders}) == 10

    missing = dedupe.get("/orders/ord_9999")
    assert missing.status_code == 404
    assert missing.json()["error"] == "not_found"


# -- dedupe / nodedupe -------------------------------------------------------


def test_dedupe_mode_applies_once_per_key(dedupe: httpx.Client) -> None:
    first = refund(dedupe, "key-a", amount_cents=1500)
    assert first.status_code == 201
    body = first.json()
    assert body["refund_id"].startswith("rf_")
    assert body["status"] == "applied"
    assert body["duplicate"] is False
    assert (body["idempotency_key"], body["order_id"], body["amount_cents"]) == (
        "key-a",
        "ord_1003",
        1500,
    )

    again = refund(dedupe, "key-a", amount_cents=1500)
    assert again.status_code == 200
    assert again.json()["duplicate"] is True
    assert again.json()["refund_id"] == body["refund_id"]

    assert len(rows_for(dedupe, "key-a")) == 1
    assert dedupe.get("/orders/ord_1003").json()["refunded_cents"] == 1500
    found = lookup(dedupe, "key-a").json()
    assert found["found"] is True
    assert [r["refund_id"] for r in found["refunds"]] == [body["refund_id"]]

    # Another key is another refund.
    assert refund(dedupe, "key-b", amount_cents=500).status_code == 201
    assert dedupe.get("/orders/ord_1003").json()["refunded_cents"] == 2000


def test_dedupe_mode_is_safe_under_concurrent_retries(dedupe: httpx.Client) -> None:
    url = str(dedupe.base_url)
    statuses: list[int] = []
    lock = threading.Lock()

    def hit() -> None:
        with httpx.Client(base_url=url, timeout=10.0) as client:
            status = refund(client, "key-race", amount_cents=100).status_code
        with lock:
            statuses.append(status)

    threads = [threading.Thread(target=hit) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()

    assert sorted(statuses) == [200] * 7 + [201]
    assert len(rows_for(dedupe, "key-race")) == 1
    assert dedupe.get("/orders/ord_1003").json()["refunded_cents"] == 100


def test_nodedupe_mode_applies_a_repeated_key_twice(nodedupe: httpx.Client) -> None:
    assert nodedupe.get("/health").json()["mode"] == "nodedupe"
    first = refund(nodedupe, "key-a", amount_cents=1500)
    second = refund(nodedupe, "key-a", amount_cents=1500)
    assert first.status_code == second.status_code == 201
    assert second.json()["duplicate"] is False
    assert first.json()["refund_id"] != second.json()["refund_id"]

    assert len(rows_for(nodedupe, "key-a")) == 2
    assert nodedupe.get("/orders/ord_1003").json()["refunded_cents"] == 3000
    found = lookup(nodedupe, "key-a").json()
    assert found["found"] is True
    assert len(found["refunds"]) == 2


def test_refunds_never_exceed_the_order_amount(nodedupe: httpx.Client) -> None:
    assert refund(nodedupe, "k", order_id="ord_1001", amount_cents=1999).status_code == 201
    order = nodedupe.get("/orders/ord_1001").json()
    assert (order["refunded_cents"], order["status"]) == (1999, "refunded")
    again = refund(nodedupe, "k", order_id="ord_1001", amount_cents=1)
    assert again.status_code == 422
    assert again.json()["error"] == "exceeds_refundable"


# -- faults ------------------------------------------------------------------


def test_drop_fault_applies_but_the_response_is_lost(nodedupe: httpx.Client) -> None:
    with pytest.raises(httpx.RemoteProtocolError):
        refund(nodedupe, "key-drop", fault="drop")

    assert len(rows_for(nodedupe, "key-drop")) == 1
    found = lookup(nodedupe, "key-drop").json()
    assert found["found"] is True
    assert found["refunds"][0]["amount_cents"] == 1000

    [entry, _lookup] = log_for(nodedupe, "key-drop")
    assert entry["method"] == "POST"
    assert entry["fault"] == "drop"
    assert entry["applied"] is True
    assert entry["response_status"] is None


def test_global_drop_queue_hits_only_the_next_request(nodedupe: httpx.Client) -> None:
    assert nodedupe.post("/faults", json={"drop_next": 1}).json()["drop_next"] == 1
    with pytest.raises(httpx.RemoteProtocolError):
        refund(nodedupe, "key-q")
    assert nodedupe.get("/faults").json()["drop_next"] == 0

    # A blind retry in nodedupe mode applies the refund a second time.
    assert refund(nodedupe, "key-q").status_code == 201
    assert len(rows_for(nodedupe, "key-q")) == 2
    assert [e["fault"] for e in log_for(nodedupe, "key-q")] == ["drop", None]


def test_5xx_fault_does_not_apply(dedupe: httpx.Client) -> None:
    resp = refund(dedupe, "key-5xx", fault="5xx")
    assert resp.status_code == 503
    assert resp.json()["error"] == "unavailable"

    dedupe.post("/faults", json={"error_next": 1})
    resp = refund(dedupe, "key-5xx")
    assert resp.status_code == 503

    assert rows_for(dedupe, "key-5xx") == []
    assert lookup(dedupe, "key-5xx").json() == {"found": False, "refunds": []}
    assert dedupe.get("/orders/ord_1003").json()["refunded_cents"] == 0

    # The queue is used up: the retry goes through.
    assert refund(dedupe, "key-5xx").status_code == 201
    posts = [e for e in log_for(dedupe, "key-5xx") if e["method"] == "POST"]
    assert [(e["fault"], e["applied"], e["response_status"]) for e in posts] == [
        ("5xx", False, 503),
        ("5xx", False, 503),
        (None, True, 201),
    ]


def test_lookup_faults(dedupe: httpx.Client) -> None:
    assert refund(dedupe, "key-l").status_code == 201

    failed = lookup(dedupe, "key-l", fault="lookup_error")
    assert failed.status_code == 500
    assert "found" not in failed.json()
    unknown = lookup(dedupe, "key-l", fault="lookup_unknown")
    assert unknown.status_code == 200
    assert unknown.json()["found"] is None
    assert unknown.json()["detail"] == "unknown"

    dedupe.post("/faults", json={"lookup_error_next": 1, "lookup_unknown_next": 1})
    assert lookup(dedupe, "key-l").status_code == 500
    assert lookup(dedupe, "key-l").json()["found"] is None
    assert lookup(dedupe, "key-l").json()["found"] is True
    assert dedupe.get("/faults").json()["lookup_error_next"] == 0

    gets = [e for e in log_for(dedupe, "key-l") if e["method"] == "GET"]
    assert [(e["fault"], e["response_status"]) for e in gets] == [
        ("lookup_error", 500),
        ("lookup_unknown", 200),
        ("lookup_error", 500),
        ("lookup_unknown", 200),
        (None, 200),
    ]


def test_latency_fault_delays_then_applies(dedupe: httpx.Client) -> None:
    started = time.monotonic()
    assert refund(dedupe, "key-slow", fault="latency=200").status_code == 201
    assert time.monotonic() - started >= 0.2

    dedupe.post("/faults", json={"latency_ms": 150, "latency_next": 1})
    started = time.monotonic()
    assert refund(dedupe, "key-slow-2").status_code == 201
    assert time.monotonic() - started >= 0.15
    assert dedupe.get("/faults").json()["latency_ms"] == 0

    assert [e["fault"] for e in log_for(dedupe, "key-slow")] == ["latency"]
    assert [e["fault"] for e in log_for(dedupe, "key-slow-2")] == ["latency"]
    assert dedupe.delete("/faults").json()["latency_next"] == 0


def test_request_log_records_every_request_with_its_fault(dedupe: httpx.Client) -> None:
    refund(dedupe, "log-1")
    refund(dedupe, "log-1")
    refund(dedupe, "log-2", fault="5xx")
    with pytest.raises(httpx.RemoteProtocolError):
        refund(dedupe, "log-3", fault="drop")
    refund(dedupe, "log-4", order_id="ord_nope")
    note = dedupe.post(
        "/notifications",
        json={"to": "a@example.com", "subject": "hi", "body": "x", "idempotency_key": "log-5"},
        headers={"X-Sandbox-Fault": "latency=10"},
    )
    assert note.status_code == 201

    log = dedupe.get("/requests").json()["requests"]
    fields = ("path", "method", "idempotency_key", "fault", "applied", "response_status")
    summary = [tuple(e[f] for f in fields) for e in log]
    assert summary == [
        ("/refunds", "POST", "log-1", None, True, 201),
        ("/refunds", "POST", "log-1", None, False, 200),
        ("/refunds", "POST", "log-2", "5xx", False, 503),
        ("/refunds", "POST", "log-3", "drop", True, None),
        ("/refunds", "POST", "log-4", None, False, 404),
        ("/notifications", "POST", "log-5", "latency", True, 201),
    ]
    assert [e["id"] for e in log] == sorted(e["id"] for e in log)
    assert all(e["received_at"].endswith("+00:00") for e in log)
    assert len(log_for(dedupe, "log-1")) == 2
    assert len(dedupe.get("/requests", params={"path": "/notifications"}).json()["requests"]) == 1


def test_notifications_always_apply(dedupe: httpx.Client) -> None:
    message = {"to": "a@example.com", "subject": "Refund", "body": "Done", "idempotency_key": "n"}
    first = dedupe.post("/notifications", json=message)
    second = dedupe.post("/notifications", json=message)
    assert first.status_code == second.status_code == 201
    ids = [first.json()["notification_id"], second.json()["notification_id"]]
    assert ids[0].startswith("nt_")
    assert ids[0] != ids[1]
    sent = dedupe.get("/notifications").json()["notifications"]
    assert [n["notification_id"] for n in sent] == ids
    assert all(n["idempotency_key"] == "n" for n in sent)


def test_reset_wipes_everything(nodedupe: httpx.Client) -> None:
    refund(nodedupe, "r")
    nodedupe.post("/notifications", json={"to": "a", "subject": "b", "body": "c"})
    nodedupe.post("/faults", json={"drop_next": 3})
    assert nodedupe.post("/reset").json() == {"ok": True}
    assert nodedupe.get("/refunds/all").json() == {"refunds": []}
    assert nodedupe.get("/notifications").json() == {"notifications": []}
    assert nodedupe.get("/requests").json() == {"requests": []}
    assert set(nodedupe.get("/faults").json().values()) == {0}
    assert nodedupe.get("/orders/ord_1003").json()["refunded_cents"] == 0


# -- validation --------------------------------------------------------------


@pytest.mark.parametrize(
    ("body", "status", "error"),
    [
        ({"order_id": "ord_1001", "amount_cents": 100}, 400, "missing_idempotency_key"),
        ({"idempotency_key": "", "order_id": "ord_1001", "amount_cents": 100}, 400, None),
        ({"idempotency_key": "k", "amount_cents": 100}, 400, "missing_order_id"),
        ({"idempotency_key": "k", "order_id": "ord_1001"}, 400, "invalid_amount"),
        ({"idempotency_key": "k", "order_id": "ord_1001", "amount_cents": "5"}, 400, None),
        ({"idempotency_key": "k", "order_id": "ord_1001", "amount_cents": 1.5}, 400, None),
        ({"idempotency_key": "k", "order_id": "ord_1001", "amount_cents": True}, 400, None),
        ({"idempotency_key": "k", "order_id": "ord_9999", "amount_cents": 100}, 404, None),
        ({"idempotency_key": "k", "order_id": "ord_1001", "amount_cents": 0}, 422, None),
        ({"idempotency_key": "k", "order_id": "ord_1001", "amount_cents": -5}, 422, None),
        (
            {"idempotency_key": "k", "order_id": "ord_1001", "amount_cents": 2000},
            422,
            "exceeds_refundable",
        ),
        ([1, 2], 400, "invalid_json"),
    ],
)
def test_refund_validation(dedupe: httpx.Client, body: Any, status: int, error: str | None) -> None:
    resp = dedupe.post("/refunds", json=body)
    assert resp.status_code == status
    payload = resp.json()
    assert isinstance(payload["error"], str)
    assert payload["detail"]
    if error is not None:
        assert payload["error"] == error
    assert dedupe.get("/refunds/all").json() == {"refunds": []}


def test_other_bad_input(dedupe: httpx.Client) -> None:
    cases = [
        dedupe.post("/refunds", content=b"{not json", headers={"Content-Type": "application/json"}),
        dedupe.post("/refunds", json={"idempotency_key": "k"}, headers={"X-Sandbox-Fault": "boom"}),
        dedupe.get("/refunds"),
        dedupe.post("/notifications", json={"to": "a@example.com", "subject": "s"}),
        dedupe.post("/faults", json={"explode_next": 1}),
        dedupe.post("/faults", json={"drop_next": -1}),
    ]
    assert [r.status_code for r in cases] == [400] * len(cases)
    assert [r.json()["error"] for r in cases] == [
        "invalid_json",
        "invalid_fault",
        "missing_idempotency_key",
        "invalid_notification",
        "invalid_faults",
        "invalid_faults",
    ]
    assert dedupe.get("/nowhere").status_code == 404
    assert dedupe.delete("/refunds/all").status_code == 405


# -- process lifecycle ---------------------------------------------------------


def test_data_persists_across_a_restart(tmp_path: Path) -> None:
    db = tmp_path / "sandbox.sqlite3"
    port = free_port()
    with start_sandbox(str(db), mode="dedupe", port=port) as sandbox, _client(sandbox) as client:
        created = refund(client, "persist", amount_cents=700).json()
        client.post("/faults", json={"drop_next": 1})

    with start_sandbox(str(db), mode="dedupe", port=port) as sandbox, _client(sandbox) as client:
        assert sandbox.port == port
        assert lookup(client, "persist").json()["refunds"][0]["refund_id"] == created["refund_id"]
        assert client.get("/orders/ord_1003").json()["refunded_cents"] == 700
        assert len(log_for(client, "persist")) == 2  # the POST and the lookup above
        assert client.get("/faults").json()["drop_next"] == 1  # the fault queue persists too
        client.delete("/faults")
        # Seeding on start is idempotent: still ten orders, refunds kept.
        assert len(client.get("/orders").json()["orders"]) == 10
        assert refund(client, "persist", amount_cents=700).json()["duplicate"] is True


def test_cli_announces_itself_and_stops_on_sigterm(tmp_path: Path) -> None:
    port = free_port()
    db = tmp_path / "nested" / "dir" / "sandbox.sqlite3"
    cmd = [sys.executable, "-m", "agentops.demo.sandbox", "--port", str(port), "--db", str(db)]
    for sig in (signal.SIGTERM, signal.SIGINT):
        proc = subprocess.Popen(
            cmd, cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        try:
            assert proc.stdout is not None
            line = proc.stdout.readline().strip()
            assert line == f"sandbox listening on http://127.0.0.1:{port} mode=dedupe deadline=off"
            assert httpx.get(f"http://127.0.0.1:{port}/health").json()["mode"] == "dedupe"
            started = time.monotonic()
            proc.send_signal(sig)
            assert proc.wait(timeout=5) == 0
            assert time.monotonic() - started < 1.0
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    assert db.exists()


def test_start_sandbox_reports_startup_failure(tmp_path: Path) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(RuntimeError, match="Address already in use"):
            start_sandbox(str(tmp_path / "s.sqlite3"), port=port)


def test_start_sandbox_picks_a_port_when_none_given(tmp_path: Path) -> None:
    sandbox = start_sandbox(str(tmp_path / "s.sqlite3"))
    try:
        assert sandbox.url == f"http://127.0.0.1:{sandbox.port}"
        assert httpx.get(f"{sandbox.url}/health").json() == {
            "ok": True,
            "mode": "nodedupe",
            "dedupe": False,
            "deadline": False,
        }
    finally:
        assert sandbox.stop() == 0
    assert sandbox.process.poll() == 0


# -- the two switches: key deduplication and deadline checking (DESIGN §9) -----------------


def _at(seconds: float) -> str:
    """A send deadline ``seconds`` from now (negative: already passed), as the engine sends it."""
    return (datetime.now(UTC) + timedelta(seconds=seconds)).isoformat()


def deadlined(client: httpx.Client, path: str, key: str, deadline: str, **body: Any):
    headers = {
        "Idempotency-Key": key,
        "X-Agentops-Fence": "7",
        "X-Agentops-Send-Deadline": deadline,
    }
    if path == "/refunds":
        body = {"idempotency_key": key, "order_id": "ord_1003", "amount_cents": 500, **body}
    else:
        body = {"to": "a@example.com", "subject": "s", "body": "b", "idempotency_key": key}
    return client.post(path, json=body, headers=headers)


def test_the_switches_are_shown_and_changed_at_runtime(nodedupe: httpx.Client) -> None:
    assert nodedupe.get("/health").json() == {
        "ok": True,
        "mode": "nodedupe",
        "dedupe": False,
        "deadline": False,
    }
    switched = nodedupe.post("/mode", json={"deadline": True}).json()
    assert switched == {"ok": True, "mode": "nodedupe", "dedupe": False, "deadline": True}
    nodedupe.post("/mode", json={"dedupe": True})
    assert nodedupe.get("/health").json()["mode"] == "dedupe"
    # now it deduplicates
    assert refund(nodedupe, "switched").status_code == 201
    assert refund(nodedupe, "switched").json()["duplicate"] is True
    assert len(rows_for(nodedupe, "switched")) == 1

    for body in ({"dedupe": "yes"}, {"other": True}, [True]):
        resp = nodedupe.post("/mode", json=body)
        assert resp.status_code == 400
        assert resp.json()["error"] in ("invalid_mode", "invalid_json")


def test_cli_switches_deduplication_and_deadlines_separately(tmp_path: Path) -> None:
    cases = [
        (["--mode", "nodedupe", "--deadline"], {"dedupe": False, "deadline": True}),
        (["--no-dedupe"], {"dedupe": False, "deadline": False}),
        (["--mode", "nodedupe", "--dedupe", "--no-deadline"], {"dedupe": True, "deadline": False}),
    ]
    for index, (args, expected) in enumerate(cases):
        port = free_port()
        cmd = [sys.executable, "-m", "agentops.demo.sandbox", "--port", str(port)]
        cmd += ["--db", str(tmp_path / f"s{index}.sqlite3"), *args]
        proc = subprocess.Popen(cmd, cwd=REPO_ROOT, stdout=subprocess.PIPE, text=True)
        try:
            assert proc.stdout is not None
            assert proc.stdout.readline().startswith("sandbox listening on")
            health = httpx.get(f"http://127.0.0.1:{port}/health").json()
            assert {name: health[name] for name in expected} == expected
        finally:
            proc.terminate()
            proc.wait(timeout=5)


def test_every_request_records_its_headers_and_when_it_was_received(
    nodedupe: httpx.Client,
) -> None:
    deadline = _at(30)
    before = datetime.now(UTC)
    assert deadlined(nodedupe, "/refunds", "hdr", deadline).status_code == 201
    (entry,) = log_for(nodedupe, "hdr")
    assert entry["fence"] == "7"
    assert datetime.fromisoformat(entry["send_deadline"]) == datetime.fromisoformat(deadline)
    assert before <= datetime.fromisoformat(entry["received_at"]) <= datetime.now(UTC)
    assert entry["late"] is False and entry["refused"] is False and entry["applied"] is True
    # a request without the headers (an older client) is logged as before
    refund(nodedupe, "plain")
    (plain,) = log_for(nodedupe, "plain")
    assert plain["fence"] is None and plain["send_deadline"] is None and plain["late"] is False


@pytest.mark.parametrize("path", ["/refunds", "/notifications"])
def test_deadline_checking_on_refuses_a_late_write_without_applying_it(
    nodedupe: httpx.Client, path: str
) -> None:
    nodedupe.post("/mode", json={"deadline": True})
    resp = deadlined(nodedupe, path, "late", _at(-0.5))

    assert resp.status_code == 409
    assert resp.json()["error"] == "send_deadline_passed"
    assert rows_for(nodedupe, "late") == []
    assert nodedupe.get("/notifications").json()["notifications"] == []
    (entry,) = nodedupe.get("/requests", params={"late": 1}).json()["requests"]
    assert entry["path"] == path and entry["refused"] is True and entry["applied"] is False
    assert entry["response_status"] == 409
    summary = nodedupe.get("/requests/summary").json()
    assert {name: summary[name] for name in ("requests", "late", "late_applied", "refused")} == {
        "requests": 1,
        "late": 1,
        "late_applied": 0,
        "refused": 1,
    }
    # one in time is applied as usual
    assert deadlined(nodedupe, path, "in-time", _at(30)).status_code == 201


def test_deadline_checking_off_applies_a_late_write_but_counts_it(nodedupe: httpx.Client) -> None:
    resp = deadlined(nodedupe, "/refunds", "late", _at(-0.5))

    assert resp.status_code == 201
    assert len(rows_for(nodedupe, "late")) == 1
    (entry,) = nodedupe.get("/requests", params={"late": "1"}).json()["requests"]
    assert entry["late"] is True and entry["applied"] is True and entry["refused"] is False
    assert nodedupe.get("/requests", params={"late": "0"}).json()["requests"] == []
    summary = nodedupe.get("/requests/summary").json()
    counts = {name: summary[name] for name in ("requests", "late", "late_applied", "refused")}
    assert counts == {"requests": 1, "late": 1, "late_applied": 1, "refused": 0}


def test_deadline_checking_and_deduplication_together(dedupe: httpx.Client) -> None:
    dedupe.post("/mode", json={"deadline": True})
    assert deadlined(dedupe, "/refunds", "both", _at(30)).status_code == 201
    # the late repeat is refused before deduplication answers: still one refund
    assert deadlined(dedupe, "/refunds", "both", _at(-1)).status_code == 409
    assert deadlined(dedupe, "/refunds", "both", _at(30)).json()["duplicate"] is True
    assert len(rows_for(dedupe, "both")) == 1
    assert [entry["late"] for entry in log_for(dedupe, "both")] == [False, True, False]


def test_a_malformed_send_deadline_is_a_clear_400(nodedupe: httpx.Client) -> None:
    resp = deadlined(nodedupe, "/refunds", "bad", "tomorrow")
    assert resp.status_code == 400
    assert resp.json()["error"] == "invalid_send_deadline"
    assert rows_for(nodedupe, "bad") == []
    assert nodedupe.get("/requests", params={"late": "x"}).status_code == 400


def test_an_older_sandbox_file_gets_the_new_columns(tmp_path: Path) -> None:
    import sqlite3

    db = tmp_path / "old.sqlite3"
    conn = sqlite3.connect(db)
    conn.execute(
        "CREATE TABLE requests (id INTEGER PRIMARY KEY, path TEXT NOT NULL, method TEXT NOT NULL,"
        " idempotency_key TEXT, received_at TEXT NOT NULL, applied INTEGER NOT NULL DEFAULT 0,"
        " fault TEXT, response_status INTEGER)"
    )
    conn.execute(
        "INSERT INTO requests (path, method, received_at) VALUES ('/refunds', 'POST', 'then')"
    )
    conn.commit()
    conn.close()
    with start_sandbox(str(db), mode="nodedupe") as sandbox, _client(sandbox) as client:
        assert deadlined(client, "/refunds", "new", _at(30)).status_code == 201
        old, new = client.get("/requests").json()["requests"]
        assert old["late"] is False and old["fence"] is None
        assert new["fence"] == "7"


def test_the_sandbox_reports_the_most_writes_it_had_in_flight_and_its_rate(
    nodedupe: httpx.Client,
) -> None:
    """What a tool limit must keep, as the downstream itself sees it (issue 26): three slow
    refunds at once are three in flight; one more after them does not raise the maximum."""
    import threading

    answers: list[int] = []

    def slow(key: str) -> None:
        answers.append(refund(nodedupe, key, fault="latency=300").status_code)

    threads = [threading.Thread(target=slow, args=(f"slow-{n}",)) for n in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert answers == [201, 201, 201]
    assert refund(nodedupe, "alone").status_code == 201
    summary = nodedupe.get("/requests/summary").json()
    assert summary["max_in_flight"] == 3
    assert summary["max_in_flight_by_path"] == {"/refunds": 3}
    assert 1 <= summary["peak_requests_per_second"] <= 4
    assert summary["requests_per_second"]["/refunds"] > 0
    nodedupe.post("/reset")
    assert nodedupe.get("/requests/summary").json()["max_in_flight"] == 0


def test_a_refused_late_write_and_a_lookup_are_never_in_flight(nodedupe: httpx.Client) -> None:
    """A concurrency limit bounds the writes a downstream that checks send deadlines accepts
    (docs/agents.md "Limits"): a frozen worker's late request, refused, applied nothing and
    is not counted in flight, nor is a lookup — beside two refunds being applied, the most
    in flight stays two."""
    nodedupe.post("/mode", json={"deadline": True})
    answers: list[int] = []

    def slow(key: str) -> None:
        answers.append(deadlined(nodedupe, "/refunds", key, _at(30), amount_cents=10).status_code)

    nodedupe.post("/faults", json={"latency_ms": 600, "latency_next": 2})
    threads = [threading.Thread(target=slow, args=(f"slow-{n}",)) for n in range(2)]
    for thread in threads:
        thread.start()
    time.sleep(0.25)  # both are being applied now (600 ms each)
    late = deadlined(nodedupe, "/refunds", "late", _at(-1))
    assert late.status_code == 409
    assert lookup(nodedupe, "slow-0").status_code == 200
    for thread in threads:
        thread.join()
    assert answers == [201, 201]
    (entry,) = nodedupe.get("/requests", params={"late": 1}).json()["requests"]
    assert entry["refused"] is True and entry["applied"] is False
    summary = nodedupe.get("/requests/summary").json()
    assert summary["max_in_flight"] == 2
    assert summary["max_in_flight_by_path"] == {"/refunds": 2}

"""runs.toolhttp: a tool's timeout bounds the whole HTTP call, the first byte never leaves
after the send deadline, and the key, fence and send deadline travel as headers."""

from __future__ import annotations

import socket
import threading
import time
from datetime import UTC, datetime, timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from runs import toolhttp
from runs.registry import OutcomeUnknown, SendDeadlinePassed, ToolContext, ToolFailed


class _Handler(BaseHTTPRequestHandler):
    def log_message(self, *args):
        pass

    def do_POST(self):
        length = int(self.headers.get("Content-Length", 0))
        self.rfile.read(length)
        self.server.seen.append(dict(self.headers))
        mode = self.server.mode
        if mode == "trickle":
            self.send_response(200)
            self.send_header("Content-Length", "100")
            self.end_headers()
            for _ in range(100):
                self.wfile.write(b"x")
                self.wfile.flush()
                time.sleep(0.1)
            return
        status, body = {
            "ok": (200, b'{"ok": true}'),
            "late": (409, b'{"error": "send_deadline_passed"}'),
            "refused": (422, b'{"error": "exceeds_refundable"}'),
            "broken": (503, b'{"error": "unavailable"}'),
        }[mode]
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


@pytest.fixture
def server():
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    httpd.daemon_threads = True
    httpd.seen = []
    httpd.mode = "ok"
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield httpd
    httpd.shutdown()
    httpd.server_close()


def _ctx(timeout: float = 1.0, *, send_in: float = 1.0) -> ToolContext:
    now = time.monotonic()
    return ToolContext(
        run_id="r",
        idempotency_key="root:3",
        attempt=1,
        timeout=timeout,
        fence=7,
        send_deadline=datetime(2026, 12, 3, 12, 0, tzinfo=UTC) + timedelta(seconds=2),
        send_by=now + send_in,
        finish_by=now + timeout,
    )


def _url(server) -> str:
    return f"http://127.0.0.1:{server.server_address[1]}/refunds"


def test_the_key_fence_and_send_deadline_travel_as_headers(server):
    response = toolhttp.request(_ctx(), "POST", _url(server), json={"amount": 1})

    assert response.json() == {"ok": True}
    (headers,) = server.seen
    assert headers["Idempotency-Key"] == "root:3"
    assert headers["X-Agentops-Fence"] == "7"
    assert headers["X-Agentops-Send-Deadline"] == "2026-12-03T12:00:02+00:00"


def test_nothing_leaves_after_the_send_window(server):
    ctx = _ctx(send_in=-0.1)  # the worker was frozen past its send window

    with pytest.raises(SendDeadlinePassed):
        toolhttp.request(ctx, "POST", _url(server), json={"amount": 1})
    time.sleep(0.1)
    assert server.seen == []


def test_the_timeout_bounds_the_whole_call_not_each_phase(server):
    server.mode = "trickle"  # an answer that arrives one byte every 0.1 s
    started = time.monotonic()

    with pytest.raises(OutcomeUnknown):
        toolhttp.request(_ctx(timeout=0.6), "POST", _url(server), json={"amount": 1})

    assert time.monotonic() - started < 1.5


def test_a_silent_downstream_times_out_within_the_budget():
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)  # accepts connections, never answers
    try:
        started = time.monotonic()
        with pytest.raises(OutcomeUnknown):
            toolhttp.request(
                _ctx(timeout=0.5),
                "POST",
                f"http://127.0.0.1:{listener.getsockname()[1]}/x",
                json={},
            )
        assert time.monotonic() - started < 1.2
    finally:
        listener.close()


@pytest.mark.parametrize(
    ("mode", "raised"),
    [("late", SendDeadlinePassed), ("refused", ToolFailed), ("broken", OutcomeUnknown)],
)
def test_answers_map_onto_the_engines_outcomes(server, mode, raised):
    server.mode = mode
    with pytest.raises(raised):
        toolhttp.request(_ctx(), "POST", _url(server), json={})

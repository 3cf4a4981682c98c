"""A fake OpenAI-compatible Chat Completions server for tests: a real HTTP server on a free
port (in a thread of the test process, so worker subprocesses reach it too) that answers
``POST /v1/chat/completions`` from a script and records every request it received.

The script is a function of the request (usually of the conversation it carries), like a
real model: asked the same question twice, it answers the same way, so a test can count
requests to prove a decision was not asked for again.

It also runs on its own, answering as a model would for the demo's ``llm_refund`` agent
(docs/operations.md, "LLM agents"):

    python -m tests.support_llm --port 8766
"""

from __future__ import annotations

import argparse
import json
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from itertools import count
from typing import Any


@dataclass
class Reply:
    status: int = 200
    body: Any = None
    headers: dict[str, str] = field(default_factory=dict)


Script = Callable[[dict[str, Any], int], Reply]

_ids = count(1)


def tool_call(
    name: str,
    arguments: dict[str, Any],
    *,
    prompt_tokens: int = 100,
    completion_tokens: int = 20,
    model: str = "fake-model",
) -> Reply:
    return _completion(
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": f"call_{next(_ids)}",
                    "type": "function",
                    "function": {"name": name, "arguments": json.dumps(arguments)},
                }
            ],
        },
        "tool_calls",
        prompt_tokens,
        completion_tokens,
        model,
    )


def text(
    content: str,
    *,
    prompt_tokens: int = 100,
    completion_tokens: int = 20,
    model: str = "fake-model",
) -> Reply:
    return _completion(
        {"role": "assistant", "content": content}, "stop", prompt_tokens, completion_tokens, model
    )


def error(status: int, message: str = "error", **headers: str) -> Reply:
    return Reply(status=status, body={"error": {"message": message}}, headers=headers)


def _completion(
    message: dict[str, Any],
    finish_reason: str,
    prompt_tokens: int,
    completion_tokens: int,
    model: str,
) -> Reply:
    return Reply(
        body={
            "id": f"chatcmpl-{next(_ids)}",
            "object": "chat.completion",
            "model": model,
            "choices": [{"index": 0, "message": message, "finish_reason": finish_reason}],
            "usage": {
                "prompt_tokens": prompt_tokens,
                "completion_tokens": completion_tokens,
                "total_tokens": prompt_tokens + completion_tokens,
            },
        }
    )


def tool_results(request: dict[str, Any]) -> list[dict[str, Any]]:
    """The tool messages of a request's conversation, decoded."""
    results = []
    for message in request["messages"]:
        if message.get("role") != "tool":
            continue
        try:
            results.append(json.loads(message["content"]))
        except ValueError:
            continue  # a correction the agent sent, not a step's outcome
    return results


def refund_script(request: dict[str, Any], index: int) -> Reply:
    """The demo ``llm_refund`` agent's model: look the order up, refund it, report. Like a
    model, the answer follows from the conversation, not from a call counter."""
    results = tool_results(request)
    user = json.loads(request["messages"][1]["content"].split("Input: ", 1)[1])
    if not results:
        return tool_call("lookup_order", {"order_id": user["order_id"]})
    if len(results) == 1:
        if results[0].get("step_status") != "completed":
            return tool_call("fail_run", {"reason": f"lookup failed: {results[0].get('error')}"})
        order = results[0]["result"]
        return tool_call(
            "refund_payment",
            {
                "order_id": user["order_id"],
                "amount_cents": user["amount_cents"],
                "reason": user.get("reason", ""),
                "customer_email": order["customer"],
            },
            prompt_tokens=300,
            completion_tokens=40,
        )
    refund = results[1]
    if refund.get("step_status") != "completed":
        return text(f"The refund did not happen: {refund.get('error')}.")
    return text(f"Refunded {user['amount_cents']} cents: {refund['result']['refund_id']}.")


class FakeOpenAI:
    def __init__(self, script: Script, *, host: str = "127.0.0.1", port: int = 0) -> None:
        self.script = script
        self.requests: list[dict[str, Any]] = []
        self.headers: list[dict[str, str]] = []
        self._lock = threading.Lock()
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 (http.server's naming)
                length = int(self.headers.get("Content-Length") or 0)
                raw = self.rfile.read(length)
                if self.path.rstrip("/") != "/v1/chat/completions":
                    self._send(Reply(404, {"error": {"message": f"no route {self.path}"}}))
                    return
                body = json.loads(raw)
                with server._lock:
                    index = len(server.requests)
                    server.requests.append(body)
                    server.headers.append({k.lower(): v for k, v in self.headers.items()})
                try:
                    reply = server.script(body, index)
                except Exception as exc:  # a broken script: say so instead of hanging up
                    reply = Reply(599, {"error": {"message": f"fake script failed: {exc!r}"}})
                self._send(reply)

            def _send(self, reply: Reply) -> None:
                payload = json.dumps(reply.body).encode()
                self.send_response(reply.status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(payload)))
                for key, value in reply.headers.items():
                    self.send_header(key.replace("_", "-"), value)
                self.end_headers()
                self.wfile.write(payload)

            def log_message(self, format: str, *args: Any) -> None:
                pass  # quiet: the test reads self.requests

        self.httpd = ThreadingHTTPServer((host, port), Handler)
        self.httpd.daemon_threads = True
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    @property
    def base_url(self) -> str:
        host, port = self.httpd.server_address[:2]
        return f"http://{host}:{port}/v1"

    def start(self) -> FakeOpenAI:
        self.thread.start()
        return self

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

    @property
    def request_count(self) -> int:
        with self._lock:
            return len(self.requests)


def main() -> None:
    parser = argparse.ArgumentParser(description="A fake OpenAI-compatible API for llm_refund")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8766)
    options = parser.parse_args()
    server = FakeOpenAI(refund_script, host=options.host, port=options.port)
    print(f"fake model API at {server.base_url} (AGENTOPS_LLM_BASE_URL)", flush=True)
    try:
        server.httpd.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.httpd.server_close()


if __name__ == "__main__":
    main()

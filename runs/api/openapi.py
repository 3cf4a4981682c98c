"""OpenAPI post-processing (drf-spectacular ``POSTPROCESSING_HOOKS``).

- **Links** (OpenAPI 3 ``links``) from an operation's response to the operations a client
  performs next with the ids it returned: create a run → read it, its events, act on it,
  lease it; lease → heartbeat, step, propose, finish with the returned fence and lease token; propose →
  dispatch → receipt with the returned call id. Schemathesis follows them in its stateful
  phase; humans read them in the Swagger UI.
- ``additionalProperties: false`` on the manifest's request schemas: the server refuses
  unknown keys (a typo in a manifest must not be silently ignored), so the schema says so.
- What the serializers check across fields and drf-spectacular cannot say: a timer wait takes
  exactly one of ``until`` and ``seconds``; a question's choices are distinct.
"""

from __future__ import annotations

from typing import Any

RUN_ACTIONS = {
    "GetRun": "v1_runs_retrieve",
    "GetRunEvents": "v1_runs_events_list",
    "PauseRun": "v1_runs_pause_create",
    "ResumeRun": "v1_runs_resume_create",
    "TerminateRun": "v1_runs_terminate_create",
    "TopUpBudget": "v1_runs_budget_create",
    "SignalRun": "v1_runs_signals_create",
    "LeaseRun": "v1_runs_lease_create",
}

FENCED_RUN_ACTIONS = {
    "Heartbeat": "v1_runs_lease_heartbeat_create",
    "ReleaseLease": "v1_runs_lease_release_create",
    "RecordStep": "v1_runs_steps_create",
    "ProposeToolCall": "v1_runs_tool_calls_create",
    "FinishRun": "v1_runs_finish_create",
    "BeginWait": "v1_runs_waits_create",
}

# (path, method, status) -> {link name: link}
LINKS: dict[tuple[str, str, str], dict[str, dict[str, Any]]] = {
    ("/api/v1/runs/", "post", "201"): {
        name: {"operationId": op, "parameters": {"run_id": "$response.body#/id"}}
        for name, op in RUN_ACTIONS.items()
    },
    ("/api/v1/runs/{run_id}/", "get", "200"): {
        name: {"operationId": op, "parameters": {"run_id": "$response.body#/id"}}
        for name, op in RUN_ACTIONS.items()
        if name != "GetRun"
    },
    ("/api/v1/runs/{run_id}/lease/", "post", "200"): {
        name: {
            "operationId": op,
            "parameters": {"run_id": "$response.body#/run"},
            "requestBody": {
                "fence": "$response.body#/fence",
                "lease_token": "$response.body#/lease_token",
            },
        }
        for name, op in FENCED_RUN_ACTIONS.items()
    },
    ("/api/v1/runs/{run_id}/tool-calls/", "post", "201"): {
        "DispatchToolCall": {
            "operationId": "v1_tool_calls_dispatch_create",
            "parameters": {"tool_call_id": "$response.body#/tool_call/id"},
        },
    },
    # a retried propose gets the same call: it is dispatched the same way
    ("/api/v1/runs/{run_id}/tool-calls/", "post", "200"): {
        "DispatchToolCall": {
            "operationId": "v1_tool_calls_dispatch_create",
            "parameters": {"tool_call_id": "$response.body#/tool_call/id"},
        },
    },
    ("/api/v1/tool-calls/{tool_call_id}/dispatch/", "post", "200"): {
        "RecordReceipt": {
            "operationId": "v1_tool_calls_receipt_create",
            "parameters": {"tool_call_id": "$response.body#/tool_call/id"},
        },
    },
    ("/api/v1/approvals/{approval_id}/", "get", "200"): {
        "DecideApproval": {
            "operationId": "v1_approvals_decision_create",
            "parameters": {"approval_id": "$response.body#/id"},
        },
        "GetApprovalRun": {
            "operationId": "v1_runs_retrieve",
            "parameters": {"run_id": "$response.body#/run"},
        },
    },
    ("/api/v1/agents/{name}/", "put", "201"): {
        "GetAgent": {
            "operationId": "v1_agents_retrieve",
            "parameters": {"name": "$request.path.name"},
        }
    },
}

CLOSED_SCHEMAS = ("ManifestInputRequest", "ManifestToolRequest", "ManifestApprovalRequest")

# schema name -> keywords added to it (TimerWaitInputSerializer.validate,
# QuestionWaitInputSerializer.validate_choices)
CROSS_FIELD_RULES: dict[str, dict[str, Any]] = {
    "TimerWaitInputRequest": {"oneOf": [{"required": ["until"]}, {"required": ["seconds"]}]},
}
UNIQUE_ITEMS = {"QuestionWaitInputRequest": ("choices",)}


def add_links(result: dict[str, Any], generator: Any, request: Any, public: bool) -> dict:
    paths = result.get("paths", {})
    for (path, method, status), links in LINKS.items():
        response = paths.get(path, {}).get(method, {}).get("responses", {}).get(status)
        if response is not None:
            response["links"] = links
    schemas = result.get("components", {}).get("schemas", {})
    for name in CLOSED_SCHEMAS:
        if name in schemas:
            schemas[name]["additionalProperties"] = False
    for name, keywords in CROSS_FIELD_RULES.items():
        if name in schemas:
            schemas[name].update(keywords)
    for name, fields in UNIQUE_ITEMS.items():
        for field in fields:
            prop = schemas.get(name, {}).get("properties", {}).get(field)
            if prop is not None:
                prop["uniqueItems"] = True
    for name, schema in schemas.items():
        if name.endswith("Request"):
            _no_null_characters(schema)
    return result


def _no_null_characters(schema: dict[str, Any]) -> None:
    """Text fields refuse U+0000 (PostgreSQL cannot store it): say so in the schema."""
    for prop in schema.get("properties", {}).values():
        for text in (prop, prop.get("items") if prop.get("type") == "array" else None):
            if (
                isinstance(text, dict)
                and text.get("type") == "string"
                and not ({"pattern", "format", "enum"} & set(text))
            ):
                text["pattern"] = "^[^\\u0000]*$"

"""OpenAPI post-processing (drf-spectacular ``POSTPROCESSING_HOOKS``).

- **Links** (OpenAPI 3 ``links``) from an operation's response to the operations a client
  performs next with the ids it returned: create (or list, or fork) a run → read it, its
  events, act on it, lease it; lease → heartbeat, step, propose, wait, finish with the
  returned fence and lease token; propose → dispatch → send check, lookup, receipt → resolution; propose or
  list → approval → decision. Every operation that takes an id is the target of one
  (tests/api/test_schema.py). Schemathesis follows them in its stateful phase; humans read
  them in the Swagger UI. A new operation gets its links by adding entries to ``LINKS``.
- ``additionalProperties: false`` on the manifest's request schemas: the server refuses
  unknown keys (a typo in a manifest must not be silently ignored), so the schema says so.
- What the serializers check across fields and drf-spectacular cannot say: a timer wait takes
  exactly one of ``until`` and ``seconds``; a question's choices are distinct.
"""

from __future__ import annotations

from typing import Any

ID = "$response.body#/id"
FIRST_RESULT = "$response.body#/results/0/id"
# a run's finished steps, in a run and in a list of runs
STEPS = "$response.body#/usage/steps"
FIRST_STEPS = "$response.body#/results/0/steps_used"
# the lease's answer: its fence and its secret, which every fenced write presents
LEASED = {"fence": "$response.body#/fence", "lease_token": "$response.body#/lease_token"}
# a dispatch answers its fence; the lease token is the one its request presented
FENCE = {"fence": "$response.body#/fence", "lease_token": "$request.body#/lease_token"}
# dispatch, lookups and receipts carry the fence the request itself was fenced with
REQUEST_FENCE = {"fence": "$request.body#/fence", "lease_token": "$request.body#/lease_token"}

# link name -> operation id, for everything done to a run by its id
RUN_ACTIONS = {
    "GetRun": "v1_runs_retrieve",
    "GetRunEvents": "v1_runs_events_list",
    "PauseRun": "v1_runs_pause_create",
    "ResumeRun": "v1_runs_resume_create",
    "TerminateRun": "v1_runs_terminate_create",
    "TopUpBudget": "v1_runs_budget_create",
    "SignalRun": "v1_runs_signals_create",
    "LeaseRun": "v1_runs_lease_create",
    "RetryRecovery": "v1_runs_retry_recovery_create",
    # a finished dry run started for real (issue 23)
    "PromoteDryRun": "v1_runs_promote_create",
}

FENCED_RUN_ACTIONS = {
    "Heartbeat": "v1_runs_lease_heartbeat_create",
    "ReleaseLease": "v1_runs_lease_release_create",
    "RecordStep": "v1_runs_steps_create",
    "ProposeToolCall": "v1_runs_tool_calls_create",
    "FinishRun": "v1_runs_finish_create",
    "BeginWait": "v1_runs_waits_create",
    "PatchState": "v1_runs_state_create",
    "AppendMessages": "v1_runs_messages_create",
}


def link(operation_id: str, body: dict | None = None, **parameters: str) -> dict:
    """One OpenAPI link: the operation, its path parameters and body fields, each a runtime
    expression over the response (or the request) the link starts from."""
    found: dict[str, Any] = {"operationId": operation_id, "parameters": parameters}
    if body:
        found["requestBody"] = body
    return found


def run_links(run_id: str, steps: str, *, skip: tuple[str, ...] = ()) -> dict[str, dict]:
    """Everything done to a run by its id; a fork carries over its last finished step."""
    links = {name: link(op, run_id=run_id) for name, op in RUN_ACTIONS.items() if name not in skip}
    links["ForkRun"] = link("v1_runs_fork_create", {"from_step": steps}, run_id=run_id)
    return links


def approval_links(approval_id: str) -> dict[str, dict]:
    return {
        "GetApproval": link("v1_approvals_retrieve", approval_id=approval_id),
        "DecideApproval": link("v1_approvals_decision_create", approval_id=approval_id),
    }


def policy_version_links(version_id: str) -> dict[str, dict]:
    return {
        "GetPolicyVersion": link("v1_policy_versions_retrieve", version_id=version_id),
        "SimulatePolicyVersion": link(
            "v1_policy_versions_simulation_create", version_id=version_id
        ),
        "PublishPolicyVersion": link(
            "v1_policy_versions_publication_create", version_id=version_id
        ),
    }


PROPOSED = {
    "DispatchToolCall": link(
        "v1_tool_calls_dispatch_create", REQUEST_FENCE, tool_call_id="$response.body#/tool_call/id"
    ),
    # a call that needs an approval: what a person (or an approver's client) does next
    **approval_links("$response.body#/approval"),
}

# (path, method, status) -> {link name: link}: from every operation that creates or returns
# an object to the operations that use its id, so a client (and a stateful fuzzer) can go
# run -> lease -> tool call -> dispatch -> send check / lookup -> receipt -> resolution, and
# run -> approval -> decision, with real ids and fences
LINKS: dict[tuple[str, str, str], dict[str, dict[str, Any]]] = {
    ("/api/v1/runs/", "post", "201"): run_links(ID, STEPS),
    # an idempotent retry returns the run it created the first time
    ("/api/v1/runs/", "post", "200"): run_links(ID, STEPS),
    ("/api/v1/runs/", "get", "200"): run_links(FIRST_RESULT, FIRST_STEPS),
    ("/api/v1/runs/{run_id}/", "get", "200"): {
        **run_links(ID, STEPS, skip=("GetRun",)),
        # a run waiting for a person's answer: a member of the asked group answers
        "AnswerQuestion": link(
            "v1_questions_answer_create", question_id="$response.body#/open_waits/0/question"
        ),
    },
    ("/api/v1/runs/{run_id}/waits/", "post", "201"): {
        "AnswerQuestion": link(
            "v1_questions_answer_create", question_id="$response.body#/question"
        ),
    },
    ("/api/v1/runs/{run_id}/fork/", "post", "201"): run_links(ID, STEPS),
    ("/api/v1/runs/{run_id}/promote/", "post", "201"): run_links(ID, STEPS),
    ("/api/v1/runs/{run_id}/signals/", "post", "202"): {
        "GetSignalledRun": link("v1_runs_retrieve", run_id="$response.body#/run"),
    },
    ("/api/v1/runs/{run_id}/lease/", "post", "200"): {
        **{
            name: link(op, LEASED, run_id="$response.body#/run")
            for name, op in FENCED_RUN_ACTIONS.items()
        },
        # the conversation history a successor rebuilds its framework's messages from
        "ReadMessages": link("v1_runs_messages_retrieve", run_id="$response.body#/run"),
        # the calls MCP clients made of the agent's tools (docs/mcp.md)
        "ReadMcpCalls": link("v1_runs_mcp_calls_list", run_id="$response.body#/run"),
    },
    ("/api/v1/agents/{name}/mcp-runs/", "get", "200"): {
        "LeaseRun": link("v1_runs_lease_create", run_id="$response.body#/0/id"),
    },
    ("/api/v1/runs/{run_id}/tool-calls/", "post", "201"): PROPOSED,
    # a retried propose gets the same call: it is dispatched the same way
    ("/api/v1/runs/{run_id}/tool-calls/", "post", "200"): PROPOSED,
    ("/api/v1/tool-calls/{tool_call_id}/dispatch/", "post", "200"): {
        "CheckBeforeSending": link(
            "v1_tool_calls_send_check_create",
            {**FENCE, "attempt": "$response.body#/attempt"},
            tool_call_id="$response.body#/tool_call/id",
        ),
        "RecordReceipt": link(
            "v1_tool_calls_receipt_create", FENCE, tool_call_id="$response.body#/tool_call/id"
        ),
        "BeginLookup": link(
            "v1_tool_calls_lookups_create", FENCE, tool_call_id="$response.body#/tool_call/id"
        ),
    },
    ("/api/v1/tool-calls/{tool_call_id}/lookups/", "post", "201"): {
        # what the lookup found nothing under: an absent receipt names the lookup
        "RecordLookupReceipt": link(
            "v1_tool_calls_receipt_create",
            {**REQUEST_FENCE, "lookup": "$response.body#/lookup"},
            tool_call_id="$request.path.tool_call_id",
        ),
    },
    ("/api/v1/tool-calls/{tool_call_id}/receipt/", "post", "200"): {
        "ResolveToolCall": link("v1_tool_calls_resolution_create", tool_call_id=ID),
    },
    ("/api/v1/tool-calls/", "get", "200"): {
        "ResolveToolCall": link("v1_tool_calls_resolution_create", tool_call_id=FIRST_RESULT),
    },
    ("/api/v1/approvals/", "get", "200"): approval_links(FIRST_RESULT),
    ("/api/v1/approvals/{approval_id}/", "get", "200"): {
        "DecideApproval": approval_links(ID)["DecideApproval"],
        "GetApprovalRun": link("v1_runs_retrieve", run_id="$response.body#/run"),
    },
    ("/api/v1/approvals/{approval_id}/decision/", "post", "200"): {
        "GetApprovalRun": link("v1_runs_retrieve", run_id="$response.body#/run"),
    },
    # spend caps (runs.api.spend): a cut-off model request -> its settlement
    ("/api/v1/spend-reservations/", "get", "200"): {
        "SettleReservation": link(
            "v1_spend_reservations_settle_create", reservation_id="$response.body#/0/id"
        ),
    },
    # approval policies (approvals.policy_api): a drafted version -> read, simulate, publish
    ("/api/v1/policies/", "post", "201"): {
        **policy_version_links(ID),
        "WithdrawPolicy": link("v1_policies_withdrawal_create", policy_id="$response.body#/policy"),
    },
    ("/api/v1/policies/", "get", "200"): {
        **policy_version_links("$response.body#/0/versions/0/id"),
        "WithdrawPolicy": link("v1_policies_withdrawal_create", policy_id="$response.body#/0/id"),
    },
    # a withdrawal is a drafted version: read, simulate, publish it
    ("/api/v1/policies/{policy_id}/withdrawal/", "post", "201"): policy_version_links(ID),
    ("/api/v1/agents/{name}/", "put", "201"): {
        "GetAgent": link("v1_agents_retrieve", name="$request.path.name"),
    },
    ("/api/v1/agents/{name}/", "put", "200"): {
        "GetAgent": link("v1_agents_retrieve", name="$request.path.name"),
    },
    ("/api/v1/agents/", "get", "200"): {
        "GetAgent": link("v1_agents_retrieve", name="$response.body#/0/name"),
        "ListMcpRuns": link("v1_agents_mcp_runs_list", name="$response.body#/0/name"),
    },
    # a remote agent's manifest is registered again under the name it has
    ("/api/v1/agents/{name}/", "get", "200"): {
        "UpdateAgent": link("v1_agents_update", name="$request.path.name"),
    },
}

# request schema name -> an example: a realistic body for each operation, which the Swagger
# UI fills in and Schemathesis' examples phase sends first (docs/api.md has the same)
FENCE_EXAMPLE = {"fence": 3, "lease_token": "q6W0u1sX7m4oTz9dKc2VbA8rLhN5pEeYj3fGiS1uHwM"}
EXAMPLES: dict[str, dict[str, Any]] = {
    "RunCreateInputRequest": {
        "agent": "refund_bot",
        "goal": "Refund order 1001",
        "input": {"order_id": "ord_1001"},
        "budget": {"max_steps": 20, "max_cost": "2.50"},
    },
    "PauseInputRequest": {"reason": "Checking with the payment provider first."},
    "TerminateInputRequest": {"reason": "A duplicate of another run."},
    "BudgetTopUpInputRequest": {"add_steps": 10, "add_cost": "1.00"},
    "ForkInputRequest": {"from_step": 2},
    "ToolLimitInputRequest": {
        "tool_name": "refund_payment",
        "max_in_flight": 2,
        "rate": 10,
        "per_seconds": 60,
        "burst": 3,
        "reason": "The payment provider allows 10 refunds a minute.",
    },
    "ToolLimitRemoveRequest": {"tool_name": "refund_payment", "reason": "Lifted by the PSP."},
    "SpendCapInputRequest": {
        "scope": "principal_day",
        "subject": "alice",
        "max_cost": "25.00",
        "max_tokens": 2000000,
        "reason": "Alice's team budget.",
    },
    "SpendCapRemoveRequest": {"scope": "principal_day", "subject": "alice"},
    "SpendTopUpRequest": {
        "scope": "principal_day",
        "subject": "alice",
        "add_cost": "10.00",
        "reason": "Month-end batch approved by finance.",
    },
    "SpendSettleRequest": {"cost": "0.041200", "tokens": 10300},
    "SignalInputRequest": {
        "name": "customer_replied",
        "payload": {"text": "Yes, please."},
        "idempotency_key": "msg-8812",
    },
    "ApprovalDecisionInputRequest": {"decision": "approve", "comment": "Order checked."},
    "QuestionAnswerInputRequest": {"answer": "pro"},
    "ResolutionInputRequest": {
        "outcome": "happened",
        "external_ref": "re_3Jx9",
        "result": {"refund_id": "re_3Jx9"},
    },
    "ManifestInputRequest": {
        "version": "1",
        "input_schema": {
            "type": "object",
            "properties": {"order_id": {"type": "string"}},
            "required": ["order_id"],
        },
        "tools": [{"name": "lookup_order", "effect": "read"}],
    },
    "LeaseInputRequest": {"owner": "refund-worker-1"},
    "FenceRequest": FENCE_EXAMPLE,
    "StepInputRequest": {
        **FENCE_EXAMPLE,
        "input": {"prompt": "Refund order 1001?"},
        "output": {"plan": "refund"},
        "state": {"stage": "refund"},
        "cost": 0.0021,
        "tokens": 812,
    },
    "ProposeInputRequest": {
        **FENCE_EXAMPLE,
        "tool": "refund",
        "arguments": {"order_id": "ord_1001", "amount_cents": 500},
    },
    "SignalWaitInputRequest": {
        **FENCE_EXAMPLE,
        "kind": "signal",
        "name": "customer_replied",
        "timeout_seconds": 259200,
    },
    "TimerWaitInputRequest": {**FENCE_EXAMPLE, "kind": "timer", "seconds": 3600},
    "QuestionWaitInputRequest": {
        **FENCE_EXAMPLE,
        "kind": "question",
        "text": "Refund the shipping too?",
        "choices": ["yes", "no"],
        "default": "no",
    },
    "DispatchInputRequest": FENCE_EXAMPLE,
    "SendCheckInputRequest": {**FENCE_EXAMPLE, "attempt": 1},
    "ReceiptInputRequest": {
        **FENCE_EXAMPLE,
        "outcome": "succeeded",
        "result": {"refund_id": "re_3Jx9"},
    },
    "FinishInputRequest": {**FENCE_EXAMPLE, "status": "succeeded", "result": {"refunded": True}},
    "StatePatchInputRequest": {
        **FENCE_EXAMPLE,
        "state_version": 4,
        "patch": [
            {"op": "test", "path": "/stage", "value": "refund"},
            {"op": "add", "path": "/notes/-", "value": "customer confirmed"},
        ],
    },
    "MessagesAppendInputRequest": {
        **FENCE_EXAMPLE,
        "after_seq": 0,
        "messages": [{"role": "user", "content": "Refund order 1001"}],
    },
    "DraftInputRequest": {
        "tool": "refund_payment",
        "rules": [
            {
                "when": "args.amount_cents > 5000",
                "decide": "require_approval",
                "approval": {"group": "approver", "required": 2},
            }
        ],
        "time_zone": "Europe/Paris",
        "note": "refunds above 50.00 need two approvers",
    },
    "WithdrawInputRequest": {"note": "back to the tool's code policy: the pilot is over"},
    "SimulateInputRequest": {"days": 7},
    "RulesSimulateInputRequest": {
        "tool": "refund_payment",
        "rules": [{"when": "args.amount_cents > 100000", "decide": "deny", "reason": "too large"}],
        "days": 7,
    },
}

CLOSED_SCHEMAS = ("ManifestInputRequest", "ManifestToolRequest", "ManifestApprovalRequest")

# schema name -> keywords added to it (TimerWaitInputSerializer.validate,
# QuestionWaitInputSerializer.validate_choices)
CROSS_FIELD_RULES: dict[str, dict[str, Any]] = {
    "TimerWaitInputRequest": {"oneOf": [{"required": ["until"]}, {"required": ["seconds"]}]},
    # RFC 6902: which members each op needs (runs.remote.history applies them)
    "PatchOperationRequest": {
        "oneOf": [
            {"properties": {"op": {"enum": ["add", "replace", "test"]}}, "required": ["value"]},
            {"properties": {"op": {"enum": ["move", "copy"]}}, "required": ["from"]},
            {"properties": {"op": {"enum": ["remove"]}}},
        ]
    },
}
UNIQUE_ITEMS = {"QuestionWaitInputRequest": ("choices",)}
# amounts of money as the serializers accept them: at least one digit (DRF's own pattern
# lets "" through, which a field that is not nullable then refuses)
AMOUNT = "^\\d{1,6}(?:\\.\\d{0,6})?$"
AMOUNTS = {"SpendSettleRequest": ("cost",)}


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
    for name, example in EXAMPLES.items():
        if name in schemas:
            schemas[name]["example"] = example
    for name, keywords in CROSS_FIELD_RULES.items():
        if name in schemas:
            schemas[name].update(keywords)
    for name, fields in UNIQUE_ITEMS.items():
        for field in fields:
            prop = schemas.get(name, {}).get("properties", {}).get(field)
            if prop is not None:
                prop["uniqueItems"] = True
    for name, fields in AMOUNTS.items():
        for field in fields:
            prop = schemas.get(name, {}).get("properties", {}).get(field)
            if prop is not None:
                prop["pattern"] = AMOUNT
    for name, schema in schemas.items():
        if name.endswith("Request"):
            _no_null_characters(schema)
    return result


NO_NUL = "^[^\\u0000]*$"
# DRF trims text before it checks that it is not blank: "  " is refused as blank
NOT_BLANK = "^[^\\u0000]*[^\\s\\u0000][^\\u0000]*$"


def _no_null_characters(schema: dict[str, Any]) -> None:
    """Text fields refuse U+0000 (PostgreSQL cannot store it), and those that may not be
    blank refuse only-whitespace text: say so in the schema."""
    for prop in schema.get("properties", {}).values():
        for text in (prop, prop.get("items") if prop.get("type") == "array" else None):
            if (
                isinstance(text, dict)
                and text.get("type") == "string"
                and not ({"pattern", "format", "enum"} & set(text))
            ):
                text["pattern"] = NOT_BLANK if text.get("minLength", 0) >= 1 else NO_NUL

"""``/api/v1/`` routes, the OpenAPI schema and the Swagger UI (served locally)."""

from __future__ import annotations

from django.urls import path
from drf_spectacular.views import SpectacularAPIView, SpectacularSwaggerSplitView

from agentops.mcp import api as mcp_api
from approvals import api as approvals_api
from approvals import policy_api
from runs import api as runs_api
from runs.api import agents as agents_api
from runs.api import history as history_api
from runs.api import limits as limits_api
from runs.api import questions as questions_api
from runs.api import signals as signals_api
from runs.api import spend as spend_api
from runs.api.remote import lease as lease_api
from runs.api.remote import steps as steps_api
from runs.api.remote import toolcalls as toolcalls_api
from runs.api.remote import waits as waits_api

v1 = [
    path("health/", runs_api.HealthApi.as_view(), name="health"),
    path("agents/", runs_api.AgentListApi.as_view(), name="agents"),
    path("agents/<str:name>/", agents_api.AgentDetailApi.as_view(), name="agent"),
    path("runs/", runs_api.RunCollectionApi.as_view(), name="runs"),
    path("runs/<uuid:run_id>/", runs_api.RunDetailApi.as_view(), name="run"),
    path("runs/<uuid:run_id>/events/", runs_api.RunEventListApi.as_view(), name="run-events"),
    path("runs/<uuid:run_id>/pause/", runs_api.RunPauseApi.as_view(), name="run-pause"),
    path("runs/<uuid:run_id>/resume/", runs_api.RunResumeApi.as_view(), name="run-resume"),
    path("runs/<uuid:run_id>/terminate/", runs_api.RunTerminateApi.as_view(), name="run-terminate"),
    path("runs/<uuid:run_id>/budget/", runs_api.RunBudgetApi.as_view(), name="run-budget"),
    path("runs/<uuid:run_id>/fork/", runs_api.RunForkApi.as_view(), name="run-fork"),
    path("runs/<uuid:run_id>/promote/", runs_api.RunPromoteApi.as_view(), name="run-promote"),
    path(
        "runs/<uuid:run_id>/retry-recovery/",
        runs_api.RunRetryRecoveryApi.as_view(),
        name="run-retry-recovery",
    ),
    path("runs/<uuid:run_id>/signals/", signals_api.SignalApi.as_view(), name="run-signals"),
    # the remote-agent protocol (docs/remote-agents.md)
    path("runs/<uuid:run_id>/lease/", lease_api.LeaseApi.as_view(), name="run-lease"),
    path(
        "runs/<uuid:run_id>/lease/heartbeat/",
        lease_api.LeaseHeartbeatApi.as_view(),
        name="run-lease-heartbeat",
    ),
    path(
        "runs/<uuid:run_id>/lease/release/",
        lease_api.LeaseReleaseApi.as_view(),
        name="run-lease-release",
    ),
    path("runs/<uuid:run_id>/steps/", steps_api.StepApi.as_view(), name="run-steps"),
    path(
        "runs/<uuid:run_id>/tool-calls/", toolcalls_api.ProposeApi.as_view(), name="run-tool-calls"
    ),
    path("runs/<uuid:run_id>/waits/", waits_api.WaitApi.as_view(), name="run-waits"),
    path("runs/<uuid:run_id>/finish/", steps_api.FinishApi.as_view(), name="run-finish"),
    path("runs/<uuid:run_id>/state/", history_api.StatePatchApi.as_view(), name="run-state"),
    path("runs/<uuid:run_id>/messages/", history_api.MessagesApi.as_view(), name="run-messages"),
    # a remote agent's tools called through the MCP gateway (docs/mcp.md)
    path("runs/<uuid:run_id>/mcp-calls/", mcp_api.McpCallsApi.as_view(), name="run-mcp-calls"),
    path("agents/<str:name>/mcp-runs/", mcp_api.McpRunsApi.as_view(), name="agent-mcp-runs"),
    path("tool-calls/", runs_api.ToolCallListApi.as_view(), name="tool-calls"),
    # flow control (docs/agents.md "Limits")
    path("tool-limits/", limits_api.ToolLimitListApi.as_view(), name="tool-limits"),
    path("tool-limits/remove/", limits_api.ToolLimitRemoveApi.as_view(), name="tool-limits-remove"),
    # spend caps (docs/agents.md "Spend caps")
    path("spend-caps/", spend_api.SpendCapListApi.as_view(), name="spend-caps"),
    path("spend-caps/remove/", spend_api.SpendCapRemoveApi.as_view(), name="spend-caps-remove"),
    path("spend-caps/top-up/", spend_api.SpendTopUpApi.as_view(), name="spend-caps-top-up"),
    path(
        "spend-reservations/",
        spend_api.SpendReservationListApi.as_view(),
        name="spend-reservations",
    ),
    path(
        "spend-reservations/<int:reservation_id>/settle/",
        spend_api.SpendReservationSettleApi.as_view(),
        name="spend-reservation-settle",
    ),
    path(
        "tool-calls/<int:tool_call_id>/dispatch/",
        toolcalls_api.DispatchApi.as_view(),
        name="tool-call-dispatch",
    ),
    path(
        "tool-calls/<int:tool_call_id>/send-check/",
        toolcalls_api.SendCheckApi.as_view(),
        name="tool-call-send-check",
    ),
    path(
        "tool-calls/<int:tool_call_id>/lookups/",
        toolcalls_api.LookupApi.as_view(),
        name="tool-call-lookups",
    ),
    path(
        "tool-calls/<int:tool_call_id>/receipt/",
        toolcalls_api.ReceiptApi.as_view(),
        name="tool-call-receipt",
    ),
    path(
        "tool-calls/<int:tool_call_id>/resolution/",
        runs_api.ToolCallResolutionApi.as_view(),
        name="tool-call-resolution",
    ),
    path(
        "questions/<int:question_id>/answer/",
        questions_api.QuestionAnswerApi.as_view(),
        name="question-answer",
    ),
    path("approvals/", approvals_api.ApprovalListApi.as_view(), name="approvals"),
    path(
        "approvals/<int:approval_id>/",
        approvals_api.ApprovalDetailApi.as_view(),
        name="approval",
    ),
    path(
        "approvals/<int:approval_id>/decision/",
        approvals_api.ApprovalDecideApi.as_view(),
        name="approval-decision",
    ),
    # approval policies as data (docs/api.md, "Approval policies")
    path("policies/", policy_api.PolicyListApi.as_view(), name="policies"),
    path(
        "policies/simulations/",
        policy_api.PolicyRulesSimulateApi.as_view(),
        name="policy-simulations",
    ),
    path(
        "policies/<int:policy_id>/withdrawal/",
        policy_api.PolicyWithdrawApi.as_view(),
        name="policy-withdrawal",
    ),
    path(
        "policy-versions/<int:version_id>/",
        policy_api.PolicyVersionDetailApi.as_view(),
        name="policy-version",
    ),
    path(
        "policy-versions/<int:version_id>/simulation/",
        policy_api.PolicyVersionSimulateApi.as_view(),
        name="policy-version-simulation",
    ),
    path(
        "policy-versions/<int:version_id>/publication/",
        policy_api.PolicyVersionPublishApi.as_view(),
        name="policy-version-publication",
    ),
]

docs = [
    path("schema/", SpectacularAPIView.as_view(), name="api-schema"),
    path("docs/", SpectacularSwaggerSplitView.as_view(url_name="api-schema"), name="api-docs"),
]

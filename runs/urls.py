from __future__ import annotations

from django.urls import path

from runs import views
from runs.views import console, detail, limits, outcomes, question_link, spend

app_name = "runs"

urlpatterns = [
    # the operator console (runs.views.console)
    path("", console.dashboard, name="dashboard"),
    path("needs-you/badge/", console.needs_you_badge, name="needs_you_badge"),
    path("runs/", console.run_list, name="list"),
    path("runs/start/", console.run_start, name="start"),
    path("runs/bulk/", console.run_bulk, name="bulk"),
    path("events/", console.event_list, name="event_list"),
    path("questions/", views.question_inbox, name="questions"),
    path("questions/<int:question_id>/", views.question_detail, name="question"),
    # the run page and its actions (runs.views.detail; docs/console.md)
    path("runs/<uuid:run_id>/", detail.run_detail, name="detail"),
    path("runs/<uuid:run_id>/events/", detail.run_events, name="events"),
    path("runs/<uuid:run_id>/pause/", detail.run_pause_view, name="pause"),
    path("runs/<uuid:run_id>/resume/", detail.run_resume_view, name="resume"),
    path("runs/<uuid:run_id>/terminate/", detail.run_terminate_view, name="terminate"),
    path("runs/<uuid:run_id>/budget/", detail.run_budget_view, name="budget"),
    path(
        "runs/<uuid:run_id>/retry-recovery/",
        detail.run_retry_recovery_view,
        name="retry_recovery",
    ),
    path("runs/<uuid:run_id>/fork/", detail.run_fork_view, name="fork"),
    path("runs/<uuid:run_id>/promote/", detail.run_promote_view, name="promote"),
    # the unknown-outcomes inbox (runs.views.outcomes)
    path("unknown/", outcomes.unknown_inbox, name="unknown"),
    path("limits/", limits.tool_limits, name="limits"),
    path("spend/", spend.spend_caps, name="spend"),
    path("unknown/triage/", outcomes.unknown_triage, name="unknown_triage"),
    path("tool-calls/<int:call_id>/resolve/", outcomes.toolcall_resolve_view, name="resolve"),
    # emailed single-use link: GET shows the question, POST answers (runs.views.links)
    path("questions/link/<str:token>/", question_link.question_link, name="question_link"),
    path(
        "questions/signed-in/",
        question_link.question_link_after_sign_in,
        name="question_link_after_sign_in",
    ),
]

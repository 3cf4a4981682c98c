"""Reads. Pages and the API get their data here, with no per-row queries."""

from __future__ import annotations

from typing import Any

from django.db.models import Count, QuerySet

from runs.models import Question, Run, Step, ToolCall

# what the runs list shows; nothing else is loaded (state, input and result can be large)
_LIST_FIELDS = (
    "id",
    "agent_name",
    "agent_version",
    "goal",
    "status",
    "reason_code",
    "steps_used",
    "max_steps",
    "recovery_count",
    "created_at",
    "updated_at",
)


def run_list(*, status: str | None = None, limit: int = 100) -> QuerySet[Run]:
    """The most recent runs, newest first, optionally only those in one status."""
    runs = Run.objects.only(*_LIST_FIELDS).order_by("-created_at")
    if status:
        runs = runs.filter(status=status)
    return runs[:limit]


def run_status_counts() -> dict[str, int]:
    """How many runs are in each status (every status present, zeros included): one query."""
    counts = dict.fromkeys(Run.Status.values, 0)
    rows = Run.objects.order_by().values_list("status").annotate(n=Count("id"))
    for status, n in rows:
        counts[status] = n
    return counts


def run_get(*, run_id: Any) -> Run:
    """One run with its principal (Run.DoesNotExist if there is none)."""
    return Run.objects.select_related("principal").get(id=run_id)


def runs_for_api(*, status: str | None = None, agent: str | None = None) -> QuerySet[Run]:
    """Runs for a cursor-paginated list: list fields only, newest first."""
    runs = Run.objects.only(*_LIST_FIELDS)
    if status:
        runs = runs.filter(status=status)
    if agent:
        runs = runs.filter(agent_name=agent)
    return runs


def toolcalls_for_api(*, status: str | None = None, run: Any = None) -> QuerySet[ToolCall]:
    """Tool calls with their step and receipt (one query per page)."""
    calls = ToolCall.objects.select_related("step", "receipt")
    if status:
        calls = calls.filter(status=status)
    if run is not None:
        calls = calls.filter(run_id=run)
    return calls


# --- waits (docs/waits.md) ------------------------------------------------------------------------


def question_inbox(*, user: Any, recent: int = 20) -> tuple[list[Question], list[Question]]:
    """Open questions the user may answer (their groups; a superuser sees all), soonest to
    expire first, and the most recently settled ones: two queries."""
    questions = Question.objects.select_related("run", "answered_by").only(
        "id",
        "text",
        "choices",
        "group",
        "status",
        "asked_at",
        "expires_at",
        "answered_at",
        "channel",
        "run__id",
        "run__agent_name",
        "answered_by__username",
    )
    if not user.is_superuser:
        questions = questions.filter(group__in=user.groups.values("name"))
    open_ = list(questions.filter(status=Question.Status.OPEN).order_by("expires_at", "id"))
    settled = list(
        questions.exclude(status=Question.Status.OPEN).order_by("-asked_at", "-id")[:recent]
    )
    return open_, settled


def question_get(*, question_id: Any) -> Question:
    """One question with its run, step and who answered (Question.DoesNotExist if none)."""
    return Question.objects.select_related("run", "step", "answered_by").get(id=question_id)


def open_waits(*, run_id: Any) -> list[Step]:
    """The run's open wait steps (at most one) with their question, for the timeline and
    the API."""
    return list(
        Step.objects.filter(run_id=run_id, kind=Step.Kind.WAIT, status=Step.Status.PENDING)
        .select_related("question")
        .order_by("seq")
    )

"""Reads. Pages and the API get their data here, with no per-row queries."""

from __future__ import annotations

from typing import Any

from django.db.models import Count, QuerySet

from runs.models import Run, ToolCall

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

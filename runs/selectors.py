"""Reads. Pages and the API get their data here, with no per-row queries."""

from __future__ import annotations

from django.db.models import QuerySet

from runs.models import Run


def run_list(*, limit: int = 100) -> QuerySet[Run]:
    return Run.objects.select_related("principal").order_by("-created_at")[:limit]

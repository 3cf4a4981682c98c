from __future__ import annotations

from django.apps import AppConfig


class BenchConfig(AppConfig):
    """``make bench`` (docs/benchmarks.md): the benchmark's command and its no-op agents,
    which only the bench process and the workers it starts register."""

    name = "agentops.bench"
    label = "bench"
    default_auto_field = "django.db.models.BigAutoField"

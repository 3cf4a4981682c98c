"""Workers; django-q2's own models are not in the admin (why: below)."""

from __future__ import annotations

from django.contrib import admin
from django_q.models import Failure, OrmQ, Schedule, Success

from runs.admin.base import ReadOnlyAdmin
from runs.models import Worker


@admin.register(Worker)
class WorkerAdmin(ReadOnlyAdmin):
    list_display = ["name", "host", "pid", "health", "started_at", "heartbeat_at", "last_task_at"]
    list_filter = ["health"]
    exact_search_fields = ("name", "host")


# --- django-q2 ------------------------------------------------------------------------------------
# Its admin lets a superuser add a Schedule whose ``func`` names any importable callable, which
# the workers then run: code execution from a web form, against "read-only for everyone,
# superusers included". Queued tasks and results are the engine's plumbing, not the record.
# Schedules are made in code or a shell (docs/operations.md).
for _q_model in (Schedule, Success, Failure, OrmQ):
    if admin.site.is_registered(_q_model):
        admin.site.unregister(_q_model)

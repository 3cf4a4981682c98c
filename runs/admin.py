"""Admin for auditors: the record is read-only here; state changes go through services."""

from __future__ import annotations

from django.contrib import admin, messages

from runs.actors import Actor, PermissionDenied
from runs.models import Run, RunEvent, Step, ToolCall, ToolReceipt, Worker
from runs.services import InvalidState, run_terminate


class ReadOnlyAdmin(admin.ModelAdmin):
    def has_add_permission(self, request, obj=None):
        return False

    def has_change_permission(self, request, obj=None):
        return False

    def has_delete_permission(self, request, obj=None):
        return False


@admin.action(description="Terminate selected runs (reason: terminated from admin)")
def terminate_runs(modeladmin, request, queryset):
    actor = Actor.for_user(request.user, "admin")
    done = 0
    for run_id in queryset.values_list("id", flat=True):
        try:
            run_terminate(run_id=run_id, actor=actor, reason="terminated from admin")
            done += 1
        except (InvalidState, PermissionDenied) as exc:
            modeladmin.message_user(request, f"{run_id}: {exc}", messages.WARNING)
    modeladmin.message_user(request, f"{done} run(s) terminated or asked to terminate")


@admin.register(Run)
class RunAdmin(ReadOnlyAdmin):
    list_display = [
        "id",
        "agent_name",
        "agent_version",
        "status",
        "reason_code",
        "steps_used",
        "recovery_count",
        "created_at",
    ]
    list_filter = ["status", "agent_name", "reason_code"]
    search_fields = ["=id", "goal"]
    date_hierarchy = "created_at"
    actions = [terminate_runs]


@admin.register(Step)
class StepAdmin(ReadOnlyAdmin):
    list_display = ["run", "seq", "kind", "status", "incarnation", "created_at"]
    list_filter = ["kind", "status"]
    search_fields = ["=run__id"]


@admin.register(ToolCall)
class ToolCallAdmin(ReadOnlyAdmin):
    list_display = [
        "idempotency_key",
        "tool_name",
        "effect",
        "status",
        "attempt_count",
        "dispatched_at",
    ]
    list_filter = ["status", "tool_name", "effect"]
    search_fields = ["=idempotency_key", "=run__id"]
    exclude = ["arguments"]  # sensitive values are shown masked only


@admin.register(ToolReceipt)
class ToolReceiptAdmin(ReadOnlyAdmin):
    list_display = ["tool_call", "outcome", "source", "external_ref", "recorded_by", "created_at"]
    list_filter = ["outcome", "source"]
    search_fields = ["=external_ref", "=tool_call__idempotency_key"]


@admin.register(RunEvent)
class RunEventAdmin(ReadOnlyAdmin):
    list_display = ["run", "seq", "type", "actor", "channel", "incarnation", "created_at"]
    list_filter = ["type", "channel"]
    search_fields = ["=run__id", "actor"]
    date_hierarchy = "created_at"


@admin.register(Worker)
class WorkerAdmin(ReadOnlyAdmin):
    list_display = ["name", "host", "pid", "health", "heartbeat_at", "last_task_at"]
    list_filter = ["health"]

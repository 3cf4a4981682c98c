from __future__ import annotations

from django.contrib import admin

from approvals.models import Approval, ApprovalDecision
from runs.admin import ReadOnlyAdmin


class DecisionInline(admin.TabularInline):
    model = ApprovalDecision
    extra = 0
    can_delete = False
    fields = ["decider", "decision", "channel", "comment", "created_at"]
    readonly_fields = fields

    def has_add_permission(self, request, obj=None):
        return False


@admin.register(Approval)
class ApprovalAdmin(ReadOnlyAdmin):
    list_display = [
        "id",
        "tool_name",
        "status",
        "approver_group",
        "requested_at",
        "expires_at",
        "consumed_at",
    ]
    list_filter = ["status", "tool_name", "approver_group"]
    search_fields = ["=run__id"]
    inlines = [DecisionInline]


@admin.register(ApprovalDecision)
class ApprovalDecisionAdmin(ReadOnlyAdmin):
    list_display = ["approval", "decider", "decision", "channel", "created_at"]
    list_filter = ["decision", "channel"]

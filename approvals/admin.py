"""Approvals in the auditors' admin: read-only; decisions are made through ``approval_decide``
on the approvals pages, by email link or over the API, never here.

The question an auditor asks most — who approved the refund with external reference X? — is
one search on "Approval decisions": the external reference, idempotency key, run id or the
approver's username all match there, and the row shows who, when, through which channel.
"""

from __future__ import annotations

import json

from django.contrib import admin
from django.contrib.auth.models import Group
from django.db.models import Prefetch
from django.urls import reverse
from django.utils.html import format_html, format_html_join

from approvals.models import (
    Approval,
    ApprovalDecision,
    ApprovalLink,
    ApprovalPolicy,
    ApprovalPolicyVersion,
)
from runs.admin import ChannelFilter, ReadOnlyAdmin, ToolFilter, run_link
from runs.masking import UNMASKED, maskers_for_ids


class DecisionChannelFilter(ChannelFilter):
    """Approvals by the channel any of their decisions came through."""

    field_path = "decisions__channel"


class ApprovalToolFilter(ToolFilter):
    field_path = "approval__tool_name"


class ApproverGroupFilter(admin.SimpleListFilter):
    """By the group asked to approve: the choices are the groups, not a DISTINCT over every
    approval."""

    title = "approver group"
    parameter_name = "approver_group"

    def lookups(self, request, model_admin):
        return [
            (name, name) for name in Group.objects.order_by("name").values_list("name", flat=True)
        ]

    def queryset(self, request, queryset):
        return queryset.filter(approver_group=self.value()) if self.value() else queryset


class DecisionInline(admin.TabularInline):
    model = ApprovalDecision
    extra = 0
    can_delete = False
    readonly_fields = (
        "decider",
        "decision",
        "channel",
        "comment",
        "original_arguments_shown",
        "edited_arguments_shown",
        "created_at",
    )
    fields = readonly_fields

    def has_add_permission(self, request, obj=None):
        return False

    def has_change_permission(self, request, obj=None):
        return False

    def has_delete_permission(self, request, obj=None):
        return False

    def get_queryset(self, request):
        # inline instances are made per request: the viewer decides what is masked below
        self._viewer = request.user
        return super().get_queryset(request).select_related("decider", "approval")

    def _shown(self, obj: ApprovalDecision, value):
        # sensitive tool output copied into the arguments (runs.masking)
        if value is None:
            return "-"
        run_id = obj.approval.run_id
        mask = maskers_for_ids([run_id], user=self._viewer).get(run_id, UNMASKED)
        return json.dumps(mask(value), sort_keys=True)  # as the JSON field showed it

    @admin.display(description="original arguments")
    def original_arguments_shown(self, obj: ApprovalDecision):
        return self._shown(obj, obj.original_arguments)

    @admin.display(description="edited arguments")
    def edited_arguments_shown(self, obj: ApprovalDecision):
        return self._shown(obj, obj.edited_arguments)


def _external_ref(tool_call) -> str:
    receipt = getattr(tool_call, "receipt", None)  # a missing reverse one-to-one: None
    return receipt.external_ref if receipt else ""


@admin.register(Approval)
class ApprovalAdmin(ReadOnlyAdmin):
    list_display = [
        "id",
        "run_column",
        "tool_name",
        "idempotency_key",
        "external_ref",
        "status",
        "decided_by",
        "approver_group",
        "requested_at",
        "decided_at",
        "consumed_at",
    ]
    list_select_related = ["tool_call__receipt"]
    list_filter = ["status", ToolFilter, ApproverGroupFilter, DecisionChannelFilter]
    uuid_search_fields = ("run_id",)
    exact_search_fields = (
        "tool_call__receipt__external_ref",
        "tool_call__idempotency_key",
        "decisions__decider__username",
        "arguments_digest",
    )
    date_hierarchy = "requested_at"
    inlines = [DecisionInline]
    masked_fields = ("arguments_masked",)

    def get_queryset(self, request):
        # one query for every row's deciders, whatever the page size
        deciders = ApprovalDecision.objects.select_related("decider").order_by("created_at")
        return (
            super().get_queryset(request).prefetch_related(Prefetch("decisions", queryset=deciders))
        )

    @admin.display(description="run", ordering="run_id")
    def run_column(self, obj: Approval) -> str:
        return run_link(obj.run_id)

    @admin.display(description="idempotency key")
    def idempotency_key(self, obj: Approval) -> str:
        return obj.tool_call.idempotency_key

    @admin.display(description="external ref")
    def external_ref(self, obj: Approval) -> str:
        return _external_ref(obj.tool_call)

    @admin.display(description="decided by")
    def decided_by(self, obj: Approval) -> str:
        return format_html_join(
            ", ",
            "{} ({}, {})",
            (
                (d.decider.get_username(), d.decision, d.channel)
                for d in obj.decisions.all()
                if d.decision in ApprovalDecision.DECIDING
            ),
        )


@admin.register(ApprovalDecision)
class ApprovalDecisionAdmin(ReadOnlyAdmin):
    list_display = [
        "created_at",
        "decider",
        "decision",
        "channel",
        "tool_name",
        "external_ref",
        "idempotency_key",
        "approval_column",
        "run_column",
        "comment",
    ]
    list_select_related = ["decider", "approval__tool_call__receipt"]
    list_filter = ["decision", ChannelFilter, ApprovalToolFilter, "approval__status"]
    uuid_search_fields = ("approval__run_id",)
    exact_search_fields = (
        "approval__tool_call__receipt__external_ref",
        "approval__tool_call__idempotency_key",
        "decider__username",
    )
    date_hierarchy = "created_at"
    ordering = ["-created_at", "-id"]
    masked_fields = ("original_arguments", "edited_arguments")

    def masked_run_id(self, obj: ApprovalDecision):
        return obj.approval.run_id

    export_select_related = ("decider", "approval__tool_call__receipt")
    export_columns = (
        ("decided_at", lambda d: d.created_at.isoformat()),
        ("decider", lambda d: d.decider.get_username()),
        ("decision", lambda d: d.decision),
        ("channel", lambda d: d.channel),
        ("comment", lambda d: d.comment),
        ("approval_id", lambda d: d.approval_id),
        ("approval_status", lambda d: d.approval.status),
        ("run_id", lambda d: d.approval.run_id),
        ("tool", lambda d: d.approval.tool_name),
        ("tool_version", lambda d: d.approval.tool_version),
        ("idempotency_key", lambda d: d.approval.tool_call.idempotency_key),
        ("external_ref", lambda d: _external_ref(d.approval.tool_call)),
        ("arguments_digest", lambda d: d.approval.arguments_digest),
        ("original_arguments", lambda d: d.original_arguments),
        ("edited_arguments", lambda d: d.edited_arguments),
    )

    @admin.display(description="tool", ordering="approval__tool_name")
    def tool_name(self, obj: ApprovalDecision) -> str:
        return obj.approval.tool_name

    @admin.display(description="external ref")
    def external_ref(self, obj: ApprovalDecision) -> str:
        return _external_ref(obj.approval.tool_call)

    @admin.display(description="idempotency key")
    def idempotency_key(self, obj: ApprovalDecision) -> str:
        return obj.approval.tool_call.idempotency_key

    @admin.display(description="approval", ordering="approval_id")
    def approval_column(self, obj: ApprovalDecision) -> str:
        url = reverse("admin:approvals_approval_change", args=[obj.approval_id])
        return format_html('<a href="{}">{} ({})</a>', url, obj.approval_id, obj.approval.status)

    @admin.display(description="run")
    def run_column(self, obj: ApprovalDecision) -> str:
        return run_link(obj.approval.run_id)


@admin.register(ApprovalLink)
class ApprovalLinkAdmin(ReadOnlyAdmin):
    list_display = ["id", "approval", "approver", "kind", "created_at", "used_at"]
    list_select_related = ["approval", "approver"]
    list_filter = ["kind"]
    exact_search_fields = ("approver__username",)
    uuid_search_fields = ("approval__run_id",)
    date_hierarchy = "created_at"
    # only a hash is stored, and even that tells an auditor nothing
    exclude = ["token_hash"]


# --- approval policies: read here by auditors; managed in the console (docs/console.md) --------


class PolicyVersionInline(admin.TabularInline):
    model = ApprovalPolicyVersion
    extra = 0
    can_delete = False
    readonly_fields = (
        "number",
        "status",
        "note",
        "created_by",
        "created_at",
        "published_by",
        "published_at",
    )
    fields = readonly_fields
    ordering = ["-number"]
    show_change_link = True

    def has_add_permission(self, request, obj=None):
        return False


@admin.register(ApprovalPolicy)
class ApprovalPolicyAdmin(ReadOnlyAdmin):
    list_display = ["tool_name", "agent_name", "principal_group", "created_by", "created_at"]
    search_fields = ["tool_name", "agent_name", "principal_group"]
    inlines = [PolicyVersionInline]


@admin.register(ApprovalPolicyVersion)
class ApprovalPolicyVersionAdmin(ReadOnlyAdmin):
    list_display = [
        "policy",
        "number",
        "status",
        "withdraws",
        "created_by",
        "created_at",
        "published_by",
        "published_at",
        "approvals_required",
    ]
    list_filter = ["status", "withdraws", "policy__tool_name"]
    search_fields = ["policy__tool_name", "note", "created_by__username", "published_by__username"]
    list_select_related = ["policy", "created_by", "published_by"]
    readonly_fields = [
        "policy",
        "number",
        "status",
        "withdraws",
        "rules_shown",
        "time_zone",
        "note",
        "based_on",
        "created_by",
        "created_at",
        "published_by",
        "published_at",
        "simulated",
    ]
    exclude = ["rules"]

    @admin.display(description="rules")
    def rules_shown(self, obj):
        return format_html("<pre>{}</pre>", json.dumps(obj.rules, indent=2))

    @admin.display(description="approvals it required")
    def approvals_required(self, obj):
        url = (
            reverse("admin:approvals_approval_changelist") + f"?policy_version__id__exact={obj.id}"
        )
        return format_html('<a href="{}">approvals</a>', url)

"""Tool calls and their receipts."""

from __future__ import annotations

from typing import Any

from django.contrib import admin
from django.urls import reverse
from django.utils.html import format_html

from runs.admin.base import ReadOnlyAdmin, run_link
from runs.admin.filters import EffectFilter, ReceiptToolFilter, ToolFilter
from runs.masking import Masker
from runs.models import ToolCall, ToolReceipt


class ReceiptInline(admin.StackedInline):
    model = ToolReceipt
    extra = 0
    can_delete = False
    # the result on the receipt's own page, where it is masked for the viewer
    fields = ["outcome", "source", "external_ref", "result_link", "recorded_by", "incarnation"]
    readonly_fields = fields

    @admin.display(description="result")
    def result_link(self, obj: ToolReceipt) -> str:
        url = reverse("admin:runs_toolreceipt_change", args=[obj.pk])
        return format_html('<a href="{}">on the receipt\'s page</a>', url)

    def has_add_permission(self, request, obj=None):
        return False

    def has_change_permission(self, request, obj=None):
        return False

    def has_delete_permission(self, request, obj=None):
        return False


@admin.register(ToolCall)
class ToolCallAdmin(ReadOnlyAdmin):
    list_display = [
        "idempotency_key",
        "run_column",
        "tool_name",
        "tool_version",
        "effect",
        "status",
        "attempt_count",
        "external_ref",
        "dispatched_at",
    ]
    list_select_related = ["receipt"]
    list_filter = ["status", ToolFilter, EffectFilter]
    uuid_search_fields = ("run_id", "run__root_run_id")
    exact_search_fields = ("idempotency_key", "receipt__external_ref", "arguments_digest")
    date_hierarchy = "created_at"
    # the real arguments may hold sensitive values: only the masked copy is shown
    exclude = ["arguments"]
    inlines = [ReceiptInline]
    masked_fields = ("arguments_masked", "last_error")

    @admin.display(description="run", ordering="run_id")
    def run_column(self, obj: ToolCall) -> str:
        return run_link(obj.run_id)

    @admin.display(description="external ref")
    def external_ref(self, obj: ToolCall) -> str:
        receipt = getattr(obj, "receipt", None)  # a missing reverse one-to-one: None
        return receipt.external_ref if receipt else ""


@admin.register(ToolReceipt)
class ToolReceiptAdmin(ReadOnlyAdmin):
    list_display = [
        "external_ref",
        "tool_name",
        "idempotency_key",
        "run_column",
        "outcome",
        "source",
        "recorded_by",
        "created_at",
    ]
    list_select_related = ["tool_call"]
    list_filter = ["outcome", "source", ReceiptToolFilter]
    uuid_search_fields = ("tool_call__run_id",)
    exact_search_fields = ("external_ref", "tool_call__idempotency_key", "recorded_by")
    date_hierarchy = "created_at"

    masked_fields = ("result",)

    def masked_run_id(self, obj: ToolReceipt) -> Any:
        return obj.tool_call.run_id

    def mask_object(self, obj: ToolReceipt, mask: Masker) -> None:
        obj.result = mask.output(obj.tool_call.tool_name, obj.result)

    @admin.display(description="tool", ordering="tool_call__tool_name")
    def tool_name(self, obj: ToolReceipt) -> str:
        return obj.tool_call.tool_name

    @admin.display(description="idempotency key")
    def idempotency_key(self, obj: ToolReceipt) -> str:
        url = reverse("admin:runs_toolcall_change", args=[obj.tool_call_id])
        return format_html('<a href="{}">{}</a>', url, obj.tool_call.idempotency_key)

    @admin.display(description="run")
    def run_column(self, obj: ToolReceipt) -> str:
        return run_link(obj.tool_call.run_id)

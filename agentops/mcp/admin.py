"""The MCP gateway's rows in the admin, for auditors (read-only for everyone, as the record
is: ``runs.admin.ReadOnlyAdmin``). Which client key or digest became which call of which
run, and which run a session's calls go into. The arguments a client sent are not shown:
they are unmasked here (sensitive fields are masked on the engine's call, linked)."""

from __future__ import annotations

from django.contrib import admin
from django.urls import reverse
from django.utils.html import format_html

from agentops.mcp.models import GatewayCall, GatewaySession
from runs.admin import ReadOnlyAdmin, run_link


@admin.register(GatewaySession)
class GatewaySessionAdmin(ReadOnlyAdmin):
    list_display = ["session_key", "principal", "run_column", "updated_at"]
    fields = ["principal", "session_key", "run", "updated_at"]
    list_select_related = ["principal"]
    exact_search_fields = ("session_key", "principal__username")
    uuid_search_fields = ("run_id",)

    @admin.display(description="run", ordering="run_id")
    def run_column(self, obj: GatewaySession) -> str:
        return run_link(obj.run_id)


@admin.register(GatewayCall)
class GatewayCallAdmin(ReadOnlyAdmin):
    list_display = [
        "run_column",
        "position",
        "tool_name",
        "principal",
        "key_column",
        "tool_call_column",
        "created_at",
    ]
    fields = [
        "run",
        "position",
        "principal",
        "tool_name",
        "client_key",
        "arguments_digest",
        "tool_call",
        "created_at",
    ]
    list_select_related = ["principal"]
    exact_search_fields = ("tool_name", "client_key", "arguments_digest", "principal__username")
    uuid_search_fields = ("run_id",)
    date_hierarchy = "created_at"

    @admin.display(description="run", ordering="run_id")
    def run_column(self, obj: GatewayCall) -> str:
        return run_link(obj.run_id)

    @admin.display(description="key")
    def key_column(self, obj: GatewayCall) -> str:
        return f"client: {obj.client_key}" if obj.client_key else "arguments' digest"

    @admin.display(description="tool call", ordering="tool_call_id")
    def tool_call_column(self, obj: GatewayCall) -> str:
        if obj.tool_call_id is None:
            return "-"
        url = reverse("admin:runs_toolcall_change", args=[obj.tool_call_id])
        return format_html('<a href="{}">{}</a>', url, obj.tool_call_id)

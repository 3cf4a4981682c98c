"""Flow control's tables (docs/agents.md "Limits"): operators' limits, capacity, shares and
waiters; and the generations that tell the workers a configuration changed."""

from __future__ import annotations

from django.contrib import admin

from runs.admin.base import ReadOnlyAdmin, run_link
from runs.models import ConfigGeneration, ToolCapacity, ToolLimit, ToolShare, ToolWaiter


@admin.register(ToolLimit)
class ToolLimitAdmin(ReadOnlyAdmin):
    """Operators' limits (set in the console or the API, audited there; docs/agents.md)."""

    list_display = [
        "tool_name",
        "max_in_flight",
        "rate",
        "per_seconds",
        "burst",
        "key_argument",
        "set_by",
    ]
    exact_search_fields = ("tool_name",)


@admin.register(ToolCapacity)
class ToolCapacityAdmin(ReadOnlyAdmin):
    """Each limited tool's (and key's) rate state, locked by the dispatch transaction."""

    list_display = ["tool_name", "limit_key", "tat", "grants"]
    exact_search_fields = ("tool_name",)


@admin.register(ToolShare)
class ToolShareAdmin(ReadOnlyAdmin):
    """Fair sharing: when each principal last got a slot of a limited tool."""

    list_display = ["tool_name", "limit_key", "share", "last_grant"]
    exact_search_fields = ("tool_name", "share")


@admin.register(ToolWaiter)
class ToolWaiterAdmin(ReadOnlyAdmin):
    """Runs waiting for capacity on a limited tool, and since when."""

    list_display = ["run_column", "tool_name", "limit_key", "share", "since"]
    exact_search_fields = ("tool_name",)
    uuid_search_fields = ("run_id",)

    @admin.display(description="run", ordering="run_id")
    def run_column(self, obj: ToolWaiter) -> str:
        return run_link(obj.run_id)


@admin.register(ConfigGeneration)
class ConfigGenerationAdmin(ReadOnlyAdmin):
    """The tokens database triggers change with the principals' groups and the published
    policies (runs.record.configcache): each worker reads them again when a token moves."""

    list_display = ["name", "token"]
    exact_search_fields = ("name",)

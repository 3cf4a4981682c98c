"""Spend caps in the admin (runs.spend): read-only, for auditors. Caps are set, scopes
topped up and cut-off requests settled in the console or the API (audited there)."""

from __future__ import annotations

from django.contrib import admin

from runs.admin.base import ReadOnlyAdmin, run_link
from runs.models import SpendCap, SpendCounter, SpendReservation, SpendStop


@admin.register(SpendCap)
class SpendCapAdmin(ReadOnlyAdmin):
    """Operators' caps by scope (a principal's subject is their user id; ``*``: each)."""

    list_display = ["scope", "subject", "max_cost", "max_tokens", "set_by", "updated_at"]
    list_filter = ["scope"]
    exact_search_fields = ("subject",)


@admin.register(SpendCounter)
class SpendCounterAdmin(ReadOnlyAdmin):
    """What each capped scope spent per period: used, reserved, and operators' top-ups."""

    list_display = [
        "scope",
        "subject",
        "period",
        "cost_used",
        "cost_reserved",
        "cost_added",
        "tokens_used",
        "tokens_reserved",
        "tokens_added",
        "updated_at",
    ]
    list_filter = ["scope"]
    exact_search_fields = ("subject", "period")


@admin.register(SpendReservation)
class SpendReservationAdmin(ReadOnlyAdmin):
    """Declared maxima reserved by model requests and tool calls, and how each settled."""

    list_display = [
        "id",
        "run_column",
        "kind",
        "state",
        "cost",
        "tokens",
        "cost_settled",
        "tokens_settled",
        "settled_by",
        "created_at",
    ]
    list_filter = ["kind", "state"]
    uuid_search_fields = ("run_id",)
    date_hierarchy = "created_at"

    @admin.display(description="run", ordering="run_id")
    def run_column(self, obj: SpendReservation) -> str:
        return run_link(obj.run_id)


@admin.register(SpendStop)
class SpendStopAdmin(ReadOnlyAdmin):
    """Runs a cap stopped, and which scope's counter: a top-up of it resumes them."""

    list_display = ["run_column", "counter", "since"]
    uuid_search_fields = ("run_id",)

    @admin.display(description="run", ordering="run_id")
    def run_column(self, obj: SpendStop) -> str:
        return run_link(obj.run_id)

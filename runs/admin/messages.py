"""What goes out: the outbox's emails, webhook deliveries, operators' alerts."""

from __future__ import annotations

from django.contrib import admin

from runs.admin.base import ReadOnlyAdmin, run_link
from runs.models import Alert, OutboxMessage, WebhookDelivery


@admin.register(WebhookDelivery)
class WebhookDeliveryAdmin(ReadOnlyAdmin):
    list_display = [
        "id",
        "token",
        "event_type",
        "run_column",
        "status",
        "attempts",
        "last_status_code",
        "created_at",
        "delivered_at",
    ]
    list_select_related = ["token"]
    list_filter = ["status", "event_type"]
    uuid_search_fields = ("run_id",)
    exact_search_fields = ("token__name",)
    date_hierarchy = "created_at"
    masked_fields = ("payload",)

    @admin.display(description="run", ordering="run_id")
    def run_column(self, obj: WebhookDelivery) -> str:
        return run_link(obj.run_id)


@admin.register(OutboxMessage)
class OutboxMessageAdmin(ReadOnlyAdmin):
    """Every email the system sent or still owes (runs.outbox), for an auditor asking "was
    the approver told?". The payload is not shown: it holds the seed of the emailed link."""

    list_display = [
        "id",
        "kind",
        "to_address",
        "run_column",
        "status",
        "attempts",
        "created_at",
        "sent_at",
    ]
    list_filter = ["status", "kind"]
    uuid_search_fields = ("run_id",)
    exact_search_fields = ("to_address", "message_id")
    date_hierarchy = "created_at"
    exclude = ["payload", "claim_token"]

    @admin.display(description="run", ordering="run_id")
    def run_column(self, obj: OutboxMessage) -> str:
        return run_link(obj.run_id)


@admin.register(Alert)
class AlertAdmin(ReadOnlyAdmin):
    list_display = [
        "cause",
        "kind",
        "run_column",
        "worker_name",
        "created_at",
        "notified_at",
        "resolved_at",
    ]
    list_filter = ["kind"]
    uuid_search_fields = ("run_id",)
    exact_search_fields = ("cause", "worker_name")
    date_hierarchy = "created_at"

    @admin.display(description="run", ordering="run_id")
    def run_column(self, obj: Alert) -> str:
        return run_link(obj.run_id)

"""Durable waits: signals, questions and the questions' emailed links."""

from __future__ import annotations

from django.contrib import admin

from runs.admin.base import ReadOnlyAdmin, run_link
from runs.admin.filters import ChannelFilter
from runs.models import Question, QuestionLink, Signal


@admin.register(Signal)
class SignalAdmin(ReadOnlyAdmin):
    list_display = [
        "name",
        "run_column",
        "idempotency_key",
        "sent_by",
        "channel",
        "received_at",
        "consumed_at",
    ]
    list_filter = [ChannelFilter]
    uuid_search_fields = ("run_id",)
    exact_search_fields = ("name", "idempotency_key", "sent_by")
    date_hierarchy = "received_at"

    @admin.display(description="run", ordering="run_id")
    def run_column(self, obj: Signal) -> str:
        return run_link(obj.run_id)


@admin.register(Question)
class QuestionAdmin(ReadOnlyAdmin):
    list_display = [
        "id",
        "run_column",
        "group",
        "status",
        "asked_at",
        "expires_at",
        "answered_by",
        "channel",
    ]
    list_select_related = ["answered_by"]
    list_filter = ["status", ChannelFilter]
    uuid_search_fields = ("run_id",)
    exact_search_fields = ("group", "answered_by__username")
    date_hierarchy = "asked_at"
    masked_fields = ("text",)

    @admin.display(description="run", ordering="run_id")
    def run_column(self, obj: Question) -> str:
        return run_link(obj.run_id)


@admin.register(QuestionLink)
class QuestionLinkAdmin(ReadOnlyAdmin):
    list_display = ["id", "question", "recipient", "created_at", "used_at"]
    list_select_related = ["question", "recipient"]
    uuid_search_fields = ("question__run_id",)
    exact_search_fields = ("recipient__username",)
    date_hierarchy = "created_at"
    # only a hash is stored, and even that tells an auditor nothing
    exclude = ["token_hash"]

"""The history: run events (the hash chain) and the audit log's entries."""

from __future__ import annotations

from django import forms
from django.contrib import admin
from django.db.models import Q

from runs.admin.base import ReadOnlyAdmin, run_link
from runs.admin.filters import ActorKindFilter, EventTypeFilter, FixedChoicesFilter
from runs.models import ArchivedChain, AuditEntry, RunEvent, VerifiedChain


@admin.register(RunEvent)
class RunEventAdmin(ReadOnlyAdmin):
    list_display = [
        "id",
        "run_column",
        "seq",
        "type",
        "actor",
        "channel",
        "incarnation",
        "created_at",
    ]
    list_filter = [EventTypeFilter, "channel", ActorKindFilter]
    uuid_search_fields = ("run_id",)
    exact_search_fields = ("actor", "type", "trace_id")
    date_hierarchy = "created_at"
    # newest first along the primary key: no sort over a million rows
    ordering = ["-id"]
    masked_fields = ("payload",)
    export_columns = (
        ("run_id", lambda e: e.run_id),
        ("seq", lambda e: e.seq),
        ("created_at", lambda e: e.created_at.isoformat()),
        ("type", lambda e: e.type),
        ("actor", lambda e: e.actor),
        ("channel", lambda e: e.channel),
        ("incarnation", lambda e: e.incarnation),
        ("payload", lambda e: e.payload),
        ("payload_digest", lambda e: e.payload_digest),
        ("prev_hash", lambda e: e.prev_hash),
        ("hash", lambda e: e.hash),
    )

    @admin.display(description="run", ordering="run_id")
    def run_column(self, obj: RunEvent) -> str:
        return run_link(obj.run_id)


@admin.register(VerifiedChain)
class VerifiedChainAdmin(ReadOnlyAdmin):
    """How far ``audit_verify`` has verified each run's chain (docs/audit.md)."""

    list_display = ["run_column", "seq", "hash", "verified_at"]
    uuid_search_fields = ("run_id",)

    @admin.display(description="run", ordering="run_id")
    def run_column(self, obj: VerifiedChain) -> str:
        return run_link(obj.run_id)


@admin.register(ArchivedChain)
class ArchivedChainAdmin(ReadOnlyAdmin):
    """Runs whose events ``retention`` exported, and dropped (docs/operations.md)."""

    list_display = ["run_column", "month", "seq", "events", "export", "archived_at", "dropped_at"]
    uuid_search_fields = ("run_id",)
    exact_search_fields = ("export",)

    @admin.display(description="run", ordering="run_id")
    def run_column(self, obj: ArchivedChain) -> str:
        return run_link(obj.run_id)


class AuditActionFilter(FixedChoicesFilter):
    title = "action"
    parameter_name = "action"
    field_path = "action"
    values = (
        "agent.registered",
        "agent.updated",
        "auth.locked_out",
        # written before issue 17; failures are counted by django-axes now
        "auth.sign_in_failed",
        "auth.signed_in",
        "auth.unlocked",
        "events.archived",
        "events.dropped",
        "group.created",
        "group.deleted",
        "group.permissions_changed",
        "token.created",
        "token.revoked",
        "user.created",
        "user.deleted",
        "user.email_changed",
        "user.password_changed",
        "user.roles_changed",
    )


class AuditObjectTypeFilter(FixedChoicesFilter):
    title = "object type"
    parameter_name = "object_type"
    field_path = "object_type"
    values = ("agent", "api_token", "group", "month", "user")


@admin.register(AuditEntry)
class AuditEntryAdmin(ReadOnlyAdmin):
    list_display = [
        "created_at",
        "action",
        "actor",
        "channel",
        "ip_address",
        "object_type",
        "object_id",
    ]
    list_filter = [AuditActionFilter, "channel", AuditObjectTypeFilter, ActorKindFilter]
    exact_search_fields = ("actor", "object_id", "ip_address", "action")
    date_hierarchy = "created_at"
    ordering = ["-id"]
    export_columns = (
        ("id", lambda a: a.id),
        ("created_at", lambda a: a.created_at.isoformat()),
        ("action", lambda a: a.action),
        ("actor", lambda a: a.actor),
        ("channel", lambda a: a.channel),
        ("ip_address", lambda a: a.ip_address),
        ("user_agent", lambda a: a.user_agent),
        ("object_type", lambda a: a.object_type),
        ("object_id", lambda a: a.object_id),
        ("before", lambda a: a.before),
        ("after", lambda a: a.after),
        ("payload_digest", lambda a: a.payload_digest),
        ("prev_hash", lambda a: a.prev_hash),
        ("hash", lambda a: a.hash),
    )

    def get_search_results(self, request, queryset, search_term):
        term = search_term.strip()
        if not term:
            return queryset, False
        condition = Q(actor=term) | Q(object_id=term) | Q(action=term)
        # a username finds that person's entries whether they acted or were acted on
        condition |= Q(actor=f"user:{term}")
        try:
            forms.GenericIPAddressField().clean(term)
        except forms.ValidationError:
            pass
        else:
            condition |= Q(ip_address=term)
        return queryset.filter(condition), False

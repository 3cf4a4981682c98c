"""Admin for auditors: the record is read-only here; state changes go through services."""

from __future__ import annotations

from django import forms
from django.contrib import admin, messages
from django.template.response import TemplateResponse
from django.utils import timezone

from runs.actors import Actor, PermissionDenied
from runs.models import (
    ApiToken,
    Question,
    Run,
    RunEvent,
    Signal,
    Step,
    ToolCall,
    ToolReceipt,
    Worker,
)
from runs.services import InvalidInput, InvalidState, run_terminate
from runs.tokens import api_token_create, api_token_revoke


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


@admin.register(Signal)
class SignalAdmin(ReadOnlyAdmin):
    list_display = ["name", "run", "idempotency_key", "sent_by", "received_at", "consumed_at"]
    list_filter = ["name", "channel"]
    search_fields = ["=run__id", "name", "idempotency_key"]


@admin.register(Question)
class QuestionAdmin(ReadOnlyAdmin):
    list_display = ["id", "run", "group", "status", "asked_at", "expires_at", "answered_by"]
    list_filter = ["status", "group", "channel"]
    search_fields = ["=run__id", "text"]


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


class ApiTokenAddForm(forms.ModelForm):
    webhook_url = forms.URLField(required=False, assume_scheme="https")

    class Meta:
        model = ApiToken
        fields = ["name", "principal", "expires_at", "webhook_url"]

    def clean_principal(self):
        principal = self.cleaned_data["principal"]
        if not principal.is_active:
            raise forms.ValidationError("the principal must be an active user")
        return principal

    def clean_expires_at(self):
        expires_at = self.cleaned_data.get("expires_at")
        if expires_at is not None and expires_at <= timezone.now():
            raise forms.ValidationError("the expiry must be in the future")
        return expires_at


@admin.action(description="Revoke selected tokens")
def revoke_tokens(modeladmin, request, queryset):
    actor = Actor.for_user(request.user, "admin")
    for token_id in queryset.values_list("id", flat=True):
        try:
            api_token_revoke(token_id=token_id, actor=actor)
        except (InvalidState, PermissionDenied) as exc:
            modeladmin.message_user(request, str(exc), messages.WARNING)


@admin.register(ApiToken)
class ApiTokenAdmin(admin.ModelAdmin):
    """Tokens are created through ``api_token_create`` (the raw token is shown once, on the
    page after adding, and never stored) and otherwise only revoked."""

    list_display = [
        "name",
        "prefix",
        "principal",
        "created_by",
        "created_at",
        "expires_at",
        "revoked_at",
        "last_used_at",
    ]
    list_filter = ["revoked_at"]
    search_fields = ["name", "prefix", "principal__username"]
    actions = [revoke_tokens]
    readonly_fields = [*list_display, "webhook_url"]

    def get_fields(self, request, obj=None):
        if obj is None:
            return ApiTokenAddForm.Meta.fields
        return self.readonly_fields

    def get_readonly_fields(self, request, obj=None):
        return [] if obj is None else self.readonly_fields

    def get_form(self, request, obj=None, **kwargs):
        if obj is None:
            kwargs["form"] = ApiTokenAddForm
        return super().get_form(request, obj, **kwargs)

    def has_change_permission(self, request, obj=None):
        return False

    def has_delete_permission(self, request, obj=None):
        return False

    def save_model(self, request, obj, form, change):
        try:
            token, raw = api_token_create(
                name=obj.name,
                principal=obj.principal,
                actor=Actor.for_user(request.user, "admin"),
                expires_at=obj.expires_at,
                webhook_url=obj.webhook_url,
            )
        except (InvalidInput, PermissionDenied) as exc:
            raise forms.ValidationError(str(exc)) from None
        # the admin goes on to log the addition and redirect using obj
        obj.pk = token.pk
        obj._state.adding = False
        obj._state.db = token._state.db
        request._api_token_created = (token, raw)

    def response_add(self, request, obj, post_url_continue=None):
        token, raw = request._api_token_created
        # rendered once, straight into the response: the raw token never goes through
        # message storage (a cookie) or the database
        return TemplateResponse(
            request,
            "admin/runs/apitoken/created.html",
            {
                **self.admin_site.each_context(request),
                "opts": self.model._meta,
                "title": f"Token {token.name} created",
                "token": token,
                "raw_token": raw,
            },
        )

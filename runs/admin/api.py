"""What the API keeps: bearer tokens (created and revoked here through the services),
idempotent requests, remote agents' manifests and conversation history."""

from __future__ import annotations

from django import forms
from django.contrib import admin, messages
from django.http import HttpRequest
from django.template.response import TemplateResponse
from django.utils import timezone

from runs.actors import Actor, PermissionDenied
from runs.admin.base import AuditAdmin, ReadOnlyAdmin, run_link
from runs.models import AgentManifest, ApiToken, IdempotentRequest, RunMessage
from runs.services import InvalidInput, InvalidState
from runs.tokens import api_token_create, api_token_revoke


@admin.register(IdempotentRequest)
class IdempotentRequestAdmin(ReadOnlyAdmin):
    list_display = ["key", "principal", "run_column", "created_at"]
    list_select_related = ["principal"]
    uuid_search_fields = ("run_id",)
    exact_search_fields = ("key", "principal__username")
    date_hierarchy = "created_at"

    @admin.display(description="run", ordering="run_id")
    def run_column(self, obj: IdempotentRequest) -> str:
        return run_link(obj.run_id)


@admin.register(AgentManifest)
class AgentManifestAdmin(ReadOnlyAdmin):
    """Registered through ``PUT /api/v1/agents/{name}/`` (audited there), never edited here."""

    list_display = ["name", "version", "owner", "registered_by", "created_at", "updated_at"]
    exact_search_fields = ("name", "registered_by")


@admin.register(RunMessage)
class RunMessageAdmin(ReadOnlyAdmin):
    """A remote agent's conversation history (not authoritative, not in the hash chain).
    The messages themselves are not shown here: they may hold what the agent saw unmasked
    (only the agent's owner reads them, through the API)."""

    list_display = ["run_column", "seq", "size", "written_by", "incarnation", "created_at"]
    fields = ["run", "seq", "size", "digest", "written_by", "incarnation", "created_at"]
    uuid_search_fields = ("run_id",)
    date_hierarchy = "created_at"

    @admin.display(description="run", ordering="run_id")
    def run_column(self, obj: RunMessage) -> str:
        return run_link(obj.run_id)


# --- API tokens -------------------------------------------------------------------------------


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


@admin.action(description="Revoke selected tokens", permissions=["revoke"])
def revoke_tokens(modeladmin, request, queryset):
    actor = Actor.for_user(request.user, "admin")
    done = 0
    for token_id in queryset.values_list("id", flat=True):
        try:
            # its own transaction (a savepoint inside another): one refusal stops no other
            api_token_revoke(token_id=token_id, actor=actor, request=request)
            done += 1
        except (InvalidState, PermissionDenied) as exc:
            modeladmin.message_user(request, str(exc), messages.WARNING)
    if done:
        modeladmin.message_user(request, f"{done} token(s) revoked.", messages.SUCCESS)


@admin.register(ApiToken)
class ApiTokenAdmin(AuditAdmin):
    """Tokens are created through ``api_token_create`` (the raw token is shown once, on the
    page after adding, and never stored) and otherwise only revoked; both are audited."""

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
    list_select_related = ["principal"]
    list_filter = ["revoked_at"]
    exact_search_fields = ("name", "prefix", "principal__username")
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

    def has_revoke_permission(self, request: HttpRequest) -> bool:
        return request.user.has_perm("runs.change_apitoken")

    def get_actions(self, request):
        actions = super().get_actions(request)
        actions.pop("delete_selected", None)
        return actions

    def save_model(self, request, obj, form, change):
        try:
            token, raw = api_token_create(
                name=obj.name,
                principal=obj.principal,
                actor=Actor.for_user(request.user, "admin"),
                expires_at=obj.expires_at,
                webhook_url=obj.webhook_url,
                request=request,
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

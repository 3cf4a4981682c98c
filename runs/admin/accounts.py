"""Users, groups and sign-in lockouts: role changes and unlocks are audited in the admin's own
transaction."""

from __future__ import annotations

from axes.models import AccessAttempt
from django.contrib import admin
from django.contrib.auth import get_user_model
from django.contrib.auth.admin import GroupAdmin, UserAdmin
from django.contrib.auth.models import Group
from django.db import transaction
from django.http import HttpRequest
from django.utils import timezone

from runs.actors import Actor
from runs.audit.accounts import group_snapshot, unlocking_as, user_roles_snapshot
from runs.audit.entries import audit_record

# --- users and groups: role changes are audited -----------------------------------------------
# The admin saves users and groups itself (inside its own transaction); these wrappers take a
# snapshot before and after and append one audit entry in that same transaction, so the change
# and its record commit together.


def _admin_actor(request: HttpRequest) -> str:
    return Actor.for_user(request.user, "admin").label


User = get_user_model()


class AuditedUserAdmin(UserAdmin):
    def save_model(self, request, obj, form, change):
        stored = User.objects.get(pk=obj.pk) if change else None
        request._audit_user_before = user_roles_snapshot(stored) if change else {}
        request._audit_email_before = stored.email if change else None
        super().save_model(request, obj, form, change)

    def save_related(self, request, form, formsets, change):
        super().save_related(request, form, formsets, change)
        user = form.instance
        before_email = getattr(request, "_audit_email_before", None)
        if change and before_email != user.email:
            # approval and question links go to this address: whoever changes it can read them
            audit_record(
                action="user.email_changed",
                actor=_admin_actor(request),
                channel="admin",
                request=request,
                object_type="user",
                object_id=user.pk,
                before={"username": user.get_username(), "email": before_email},
                after={"username": user.get_username(), "email": user.email},
            )
        before = getattr(request, "_audit_user_before", {})
        after = user_roles_snapshot(user)
        if change and before == after:
            return  # a name or email edit: not a change of roles
        audit_record(
            action="user.roles_changed" if change else "user.created",
            actor=_admin_actor(request),
            channel="admin",
            request=request,
            object_type="user",
            object_id=user.pk,
            before=before or None,
            after=after,
        )

    def delete_model(self, request, obj):
        before = user_roles_snapshot(obj)
        audit_record(
            action="user.deleted",
            actor=_admin_actor(request),
            channel="admin",
            request=request,
            object_type="user",
            object_id=obj.pk,
            before=before,
        )
        super().delete_model(request, obj)

    def delete_queryset(self, request, queryset):
        for user in queryset:
            self.delete_model(request, user)

    def user_change_password(self, request, id, form_url=""):
        # one transaction: the new password and its audit entry commit together
        with transaction.atomic():
            response = super().user_change_password(request, id, form_url)
            if request.method == "POST" and response.status_code == 302:
                audit_record(
                    action="user.password_changed",
                    actor=_admin_actor(request),
                    channel="admin",
                    request=request,
                    object_type="user",
                    object_id=id,
                )
        return response


class AuditedGroupAdmin(GroupAdmin):
    def save_model(self, request, obj, form, change):
        before = group_snapshot(Group.objects.get(pk=obj.pk)) if change else {}
        request._audit_group_before = before
        super().save_model(request, obj, form, change)

    def save_related(self, request, form, formsets, change):
        super().save_related(request, form, formsets, change)
        group = form.instance
        before = getattr(request, "_audit_group_before", {})
        after = group_snapshot(group)
        if change and before == after:
            return
        audit_record(
            action="group.permissions_changed" if change else "group.created",
            actor=_admin_actor(request),
            channel="admin",
            request=request,
            object_type="group",
            object_id=group.pk,
            before=before or None,
            after=after,
        )

    def delete_model(self, request, obj):
        audit_record(
            action="group.deleted",
            actor=_admin_actor(request),
            channel="admin",
            request=request,
            object_type="group",
            object_id=obj.pk,
            before=group_snapshot(obj),
        )
        super().delete_model(request, obj)

    def delete_queryset(self, request, queryset):
        for group in queryset:
            self.delete_model(request, group)


for _model, _admin_class in ((User, AuditedUserAdmin), (Group, AuditedGroupAdmin)):
    if admin.site.is_registered(_model):
        admin.site.unregister(_model)
    admin.site.register(_model, _admin_class)


# --- sign-in lockouts (django-axes) -------------------------------------------------------------


@admin.register(AccessAttempt)
class SignInLockoutAdmin(admin.ModelAdmin):
    """Failed sign-ins per username and address, as django-axes counts them. Deleting rows
    is the unlock: each lifted lockout is an ``auth.unlocked`` audit entry naming who."""

    list_display = ("username", "ip_address", "failures_since_start", "attempt_time", "locked")
    list_filter = ("attempt_time",)
    search_fields = ("=username", "=ip_address")
    ordering = ("-attempt_time",)
    fields = ("username", "ip_address", "user_agent", "failures_since_start", "attempt_time")
    readonly_fields = fields

    @admin.display(boolean=True, description="locked out")
    def locked(self, obj: AccessAttempt) -> bool:
        from django.conf import settings

        return obj.failures_since_start >= settings.AXES_FAILURE_LIMIT and (
            obj.attempt_time >= timezone.now() - settings.AXES_COOLOFF_TIME
        )

    def has_add_permission(self, request, obj=None):
        return False

    def has_change_permission(self, request, obj=None):
        return False

    def delete_model(self, request, obj):
        with transaction.atomic(), unlocking_as(_admin_actor(request), "admin", request):
            super().delete_model(request, obj)

    def delete_queryset(self, request, queryset):
        with transaction.atomic(), unlocking_as(_admin_actor(request), "admin", request):
            super().delete_queryset(request, queryset)

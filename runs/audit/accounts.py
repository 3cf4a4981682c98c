"""What the audit log records about people: sign-ins, lockouts and unlocks (Django's and
django-axes's signals), and snapshots of users' and groups' roles for role changes."""

from __future__ import annotations

import contextvars
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from django.utils import timezone

from runs.audit.entries import audit_record, request_ip

# Django's user_logged_in / user_login_failed signals are the only hook it offers for every
# way a person signs in (the admin's login page, the console's, a test client's login). They
# are connected in ``RunsConfig.ready``.


def _sign_in_channel(request: Any) -> str:
    from django.urls import NoReverseMatch, reverse

    path = getattr(request, "path", "") or ""
    try:
        admin_prefix = reverse("admin:index")
    except NoReverseMatch:
        return "web"
    return "admin" if path.startswith(admin_prefix) else "web"


def on_user_logged_in(sender: Any, request: Any, user: Any, **kwargs: Any) -> None:
    audit_record(
        action="auth.signed_in",
        actor=f"user:{user.get_username()}",
        channel=_sign_in_channel(request),
        request=request,
        object_type="user",
        object_id=user.pk,
        after={"username": user.get_username(), "path": getattr(request, "path", "") or ""},
    )


# Failed sign-ins are not audit entries: one per failure, under the audit log's global lock,
# let anyone slow every audited action down and fill the log by typing wrong passwords.
# django-axes counts them (per username and address, in its own table, without that lock);
# the audit log records what a person acts on: the lockout, and who lifted it.


def sign_in_client_address(request: Any) -> str | None:
    """The address django-axes counts failures under (``AXES_CLIENT_IP_CALLABLE``): the
    connection's, like ``request_ip``, but an IPv6 address as its /64 — one subscriber
    usually holds a whole /64 and could otherwise try each username from endless addresses."""
    import ipaddress

    address = request_ip(request)
    if address is None:
        return None
    parsed = ipaddress.ip_address(address)
    if parsed.version == 6:
        if parsed.ipv4_mapped is not None:
            return str(parsed.ipv4_mapped)
        return str(ipaddress.ip_network(f"{parsed}/64", strict=False).network_address)
    return address


def on_user_locked_out(sender: Any, request: Any, username: Any, ip_address: Any, **kwargs):
    """django-axes's ``user_locked_out``: sent for the failure that reaches the limit and for
    every failure after it while locked. Only the first is recorded — one entry per lockout,
    however long someone keeps trying."""
    from django.conf import settings

    failures = getattr(request, "axes_failures_since_start", None)
    if failures != settings.AXES_FAILURE_LIMIT:
        return
    audit_record(
        action="auth.locked_out",
        actor="anonymous",
        channel=_sign_in_channel(request),
        request=request,
        object_type="user",
        object_id=str(username or "")[:200],
        after={
            "username": str(username or "")[:150],
            "ip_address": ip_address,
            "failures": failures,
            "locked_for_seconds": int(settings.AXES_COOLOFF_TIME.total_seconds()),
            "path": getattr(request, "path", "") or "",
        },
    )


# who is lifting lockouts in this thread (the admin's action sets it); None: a command
_unlocking: contextvars.ContextVar[tuple[str, str, Any] | None] = contextvars.ContextVar(
    "agentops_unlocking", default=None
)


@contextmanager
def unlocking_as(actor: str, channel: str, request: Any = None) -> Iterator[None]:
    token = _unlocking.set((actor, channel, request))
    try:
        yield
    finally:
        _unlocking.reset(token)


def on_access_attempt_deleted(sender: Any, instance: Any, **kwargs: Any) -> None:
    """A deleted django-axes attempt that was still locking someone out is an unlock: the
    admin's delete, ``axes_reset*`` commands. Expired attempts (cleaned up as they are
    passed) and the failures a successful sign-in clears locked nobody: not recorded."""
    from django.conf import settings

    if (instance.failures_since_start or 0) < settings.AXES_FAILURE_LIMIT:
        return
    if instance.attempt_time < timezone.now() - settings.AXES_COOLOFF_TIME:
        return
    actor, channel, request = _unlocking.get() or ("system", "cli", None)
    audit_record(
        action="auth.unlocked",
        actor=actor,
        channel=channel,
        request=request,
        object_type="user",
        object_id=str(instance.username or "")[:200],
        after={
            "username": str(instance.username or "")[:150],
            "ip_address": instance.ip_address,
            "failures": instance.failures_since_start,
        },
    )


def connect_signals() -> None:
    from axes.models import AccessAttempt
    from axes.signals import user_locked_out
    from django.contrib.auth.signals import user_logged_in
    from django.db.models.signals import post_delete

    user_logged_in.connect(on_user_logged_in, dispatch_uid="agentops.audit.signed_in")
    user_locked_out.connect(on_user_locked_out, dispatch_uid="agentops.audit.locked_out")
    post_delete.connect(
        on_access_attempt_deleted, sender=AccessAttempt, dispatch_uid="agentops.audit.unlocked"
    )


# --- users' roles -----------------------------------------------------------------------------


def user_roles_snapshot(user: Any) -> dict[str, Any]:
    """What an auditor needs to see change: the groups (roles) and the flags that grant
    access. Permissions granted to a user directly are part of it too."""
    if user is None or user.pk is None:
        return {}
    return {
        "username": user.get_username(),
        "groups": sorted(user.groups.values_list("name", flat=True)),
        "user_permissions": sorted(
            f"{app}.{codename}"
            for app, codename in user.user_permissions.values_list(
                "content_type__app_label", "codename"
            )
        ),
        "is_active": user.is_active,
        "is_staff": user.is_staff,
        "is_superuser": user.is_superuser,
    }


def group_snapshot(group: Any) -> dict[str, Any]:
    if group is None or group.pk is None:
        return {}
    return {
        "name": group.name,
        "permissions": sorted(
            f"{app}.{codename}"
            for app, codename in group.permissions.values_list(
                "content_type__app_label", "codename"
            )
        ),
    }

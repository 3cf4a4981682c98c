"""API tokens for agents and service accounts (issue 6).

A token is random, shown once, and stored only as its SHA-256 hash: the database never holds
anything that authenticates. Each token acts as its principal, with the principal's groups,
so revoking the principal (or deactivating the user) revokes every token it has.
"""

from __future__ import annotations

import hashlib
import secrets
from datetime import datetime, timedelta
from typing import Any

from django.db import IntegrityError, transaction
from django.db.models import Q
from django.db.models.functions import Now
from django.utils import timezone

from runs.actors import Actor
from runs.audit.entries import audit_record
from runs.models import ApiToken
from runs.services import InvalidInput, InvalidState

# tells a leaked agentops token apart in logs and secret scanners
RAW_PREFIX = "ao_"
PREFIX_LENGTH = 10
# last_used_at is a hint for people, not an audit record: writing it at most once a minute
# keeps a busy agent's every request from being a write
LAST_USED_RESOLUTION = timedelta(seconds=60)


class TokenNameTaken(InvalidInput):
    pass


def token_hash(raw: str) -> str:
    return hashlib.sha256(raw.encode()).hexdigest()


def api_token_create(
    *,
    name: str,
    principal: Any,
    actor: Actor,
    expires_at: datetime | None = None,
    webhook_url: str = "",
    request: Any = None,
) -> tuple[ApiToken, str]:
    """Create a token acting as ``principal``; return it with the raw secret, which is not
    stored and cannot be shown again. Recorded in the audit log (``token.created``); the
    ``request``, when there is one, supplies the IP address and user agent."""
    actor.require("runs.add_apitoken")
    name = name.strip()
    if not name:
        raise InvalidInput("a token needs a name")
    if principal is None or not principal.is_active:
        raise InvalidInput("the principal must be an active user")
    if expires_at is not None and expires_at <= timezone.now():
        raise InvalidInput("the expiry must be in the future")
    raw = RAW_PREFIX + secrets.token_urlsafe(32)
    try:
        with transaction.atomic():
            token = ApiToken.objects.create(
                name=name,
                prefix=raw[:PREFIX_LENGTH],
                token_hash=token_hash(raw),
                principal=principal,
                created_by=actor.label,
                expires_at=expires_at,
                webhook_url=webhook_url,
                webhook_secret=secrets.token_hex(32) if webhook_url else "",
            )
            audit_record(
                action="token.created",
                actor=actor.label,
                channel=actor.channel,
                request=request,
                object_type="api_token",
                object_id=token.pk,
                after=_token_snapshot(token),
            )
    except IntegrityError:
        # the hash is 256 random bits: only the name can collide
        raise TokenNameTaken(f"a token named {name!r} already exists") from None
    return token, raw


def api_token_revoke(*, token_id: Any, actor: Actor, request: Any = None) -> ApiToken:
    """Revoke a token for good. Revoking twice is refused so the first time stays recorded.
    Recorded in the audit log (``token.revoked``) in the same transaction."""
    actor.require("runs.change_apitoken")
    with transaction.atomic():
        updated = ApiToken.objects.filter(id=token_id, revoked_at__isnull=True).update(
            revoked_at=Now()
        )
        token = ApiToken.objects.get(id=token_id)  # DoesNotExist for an unknown id
        if not updated:
            raise InvalidState(f"token {token.name} is already revoked")
        after = _token_snapshot(token)
        audit_record(
            action="token.revoked",
            actor=actor.label,
            channel=actor.channel,
            request=request,
            object_type="api_token",
            object_id=token.pk,
            before={**after, "revoked_at": None},
            after=after,
        )
    return token


def _token_snapshot(token: ApiToken) -> dict[str, Any]:
    # never the hash or the webhook secret: the audit log is read by auditors
    return {
        "name": token.name,
        "prefix": token.prefix,
        "principal": token.principal.get_username(),
        "expires_at": token.expires_at.isoformat() if token.expires_at else None,
        "revoked_at": token.revoked_at.isoformat() if token.revoked_at else None,
        "webhook_url": token.webhook_url,
    }


def api_token_authenticate(raw: str) -> ApiToken | None:
    """The live token for ``raw`` (not revoked, not expired, its principal active), or None."""
    token = (
        ApiToken.objects.select_related("principal")
        .filter(token_hash=token_hash(raw), revoked_at__isnull=True)
        .filter(Q(expires_at__isnull=True) | Q(expires_at__gt=Now()))
        .first()
    )
    if token is None or not token.principal.is_active:
        return None
    now = timezone.now()
    if token.last_used_at is None or token.last_used_at < now - LAST_USED_RESOLUTION:
        # a plain UPDATE of one column: no read-modify-write, no signal, no lock held
        ApiToken.objects.filter(id=token.id).update(last_used_at=now)
        token.last_used_at = now
    return token

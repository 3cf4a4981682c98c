"""Emailed links (docs/links.md): one module for approval links and question links.

A link is one row per recipient of one object (an approval, a question) holding only the
sha256 of a random token; the token itself is derived from a seed in the outbox row that
mails it (``link_token``), so neither the database nor a log holds anything that opens it.
A link

- decides only for its recipient, signed in: the token alone (a forwarded email, a mail
  scanner) decides nothing, except where the kind allows a bearer link for this object (an
  approval policy's ``bearer_links``, 1-of-1);
- is single use: a conditional UPDATE of ``used_at`` in the same transaction as what it
  does, so a refused decision leaves it unused and a second use (a double click, a retried
  request) does nothing;
- expires with its object (the kind's service refuses a late decision; the page says so).

What is shared lives here: making a token and its email (``emailed_link``), its lookup,
who may use a link, its single use and the ``<kind>.link_used`` event (who, signed in or
not, from which address and user agent). What differs is declared by each kind
(``LinkKind``): ``APPROVAL_LINKS`` in ``approvals.services`` and ``QUESTION_LINKS`` in
``runs.waits``; their pages (``runs.views.links.LinkPage``) in ``approvals.views`` and
``runs.views.question_link``.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import secrets
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from django.conf import settings
from django.db import models, transaction
from django.db.models.functions import Now
from django.urls import reverse

from runs.actors import Actor, PermissionDenied
from runs.errors import InvalidState, NotFound
from runs.outbox import Email
from runs.record.checkpoint import checkpoint

EMAIL_CHANNEL = "email"
# a token is 43 characters (32 bytes, base64url); anything much longer is not one of ours
TOKEN_MAX_LENGTH = 128
# what of the requesting client's User-Agent the event keeps
USER_AGENT_MAX = 300

T = TypeVar("T")


class LinkInvalid(NotFound):
    """No link has this token: mistyped, truncated or forged."""


class LinkUsed(InvalidState):
    code = "already_decided"
    status = 409


class LinkLoginRequired(PermissionDenied):
    """The link decides only for its recipient, signed in."""


class LinkNotYours(PermissionDenied):
    """Someone signed in as another person opened a link mailed to someone else."""


@dataclass(frozen=True)
class LinkKind:
    """What one kind of emailed link has of its own (the rows differ: one table per kind)."""

    name: str  # "approval", "question": the prefix of its events
    model: type[models.Model]  # the link rows: token_hash, used_at, <subject>, <recipient>
    subject: str  # the link's foreign key to what it decides: "approval", "question"
    recipient: str  # the link's foreign key to the person it was mailed to
    related: tuple[str, ...]  # select_related for a link's page and its decision
    login_required_message: str
    # may the token alone (nobody signed in) use this link? Never for questions; an approval
    # only where its policy opted into bearer links for one approver
    bearer_allowed: Callable[[Any], bool] = lambda link: False
    # what ``<name>.link_used`` says of the link beyond what every kind's says
    event_fields: Callable[[Any], dict[str, Any]] = lambda link: {}

    def subject_of(self, link: Any) -> Any:
        return getattr(link, self.subject)

    def recipient_of(self, link: Any) -> Any:
        return getattr(link, self.recipient)

    def recipient_id(self, link: Any) -> Any:
        return getattr(link, f"{self.recipient}_id")


# --- tokens --------------------------------------------------------------------------------


def link_seed() -> str:
    return secrets.token_urlsafe(16)


def link_token(seed: str) -> str:
    """The emailed link's token, derived from the outbox row's seed with the server's secret
    key. Only its sha256 is stored with the link and the seed alone opens nothing (reading
    the database is not enough); a retry derives the same token, so the second copy of a
    message carries the same working link as the first."""
    # the label predates this module: changing it would break every link already mailed
    mac = hmac.new(
        settings.SECRET_KEY.encode(), b"agentops.outbox.link:" + seed.encode(), hashlib.sha256
    )
    return base64.urlsafe_b64encode(mac.digest()).rstrip(b"=").decode()


def hash_token(token: str) -> str:
    """What a link row stores of its token."""
    return hashlib.sha256(token.encode()).hexdigest()


def link_url(url_name: str, seed: str) -> str:
    """The address mailed for the link made with ``seed`` (``AGENTOPS_BASE_URL``)."""
    base = settings.AGENTOPS["BASE_URL"].rstrip("/")
    return base + reverse(url_name, args=[link_token(seed)])


def emailed_link(
    *, kind: str, recipient: Any, run_id: Any, payload: dict[str, Any], create_link: Any
) -> Email:
    """Inside the transaction that calls for it, one recipient's emailed link: a fresh
    seed, the link row that ``create_link(token_hash=…)`` makes with the hash of the token
    derived from it, and the outbox email (of outbox kind ``kind``) whose payload names the
    link and carries the seed."""
    seed = link_seed()
    link = create_link(token_hash=hash_token(link_token(seed)))
    return Email(
        kind=kind,
        to_address=recipient.email,
        recipient_id=recipient.pk,
        run_id=run_id,
        payload={**payload, "link": link.id, "seed": seed},
    )


# --- kinds ---------------------------------------------------------------------------------

_kinds: dict[str, LinkKind] = {}


def register(kind: LinkKind) -> LinkKind:
    _kinds[kind.name] = kind
    return kind


def kinds() -> dict[str, LinkKind]:
    return dict(_kinds)


def link_get(kind: LinkKind, token: str) -> Any:
    """The link this token belongs to, or ``LinkInvalid``."""
    if not token or len(token) > TOKEN_MAX_LENGTH:
        raise LinkInvalid("this link is not valid")
    link = (
        kind.model.objects.select_related(*kind.related)
        .filter(token_hash=hash_token(token))
        .first()
    )
    if link is None:
        raise LinkInvalid("this link is not valid")
    return link


def link_check_user(kind: LinkKind, link: Any, user: Any) -> None:
    """A signed-in user must be the link's recipient; nobody signed in may use it only where
    the kind allows a bearer link (DESIGN §9: who writes is who is named)."""
    signed_in = user is not None and user.is_authenticated
    if signed_in and user.pk != kind.recipient_id(link):
        raise LinkNotYours(
            f"this link was sent to {kind.recipient_of(link).get_username()}; "
            f"you are signed in as {user.get_username()}"
        )
    if not signed_in and not kind.bearer_allowed(link):
        raise LinkLoginRequired(kind.login_required_message)


def link_use(
    kind: LinkKind,
    *,
    token: str,
    user: Any,
    act: Callable[[Any, Actor], T],
    client_ip: str = "",
    user_agent: str = "",
) -> T:
    """Use a link once (POST only): ``act(link, actor)`` decides as the link's recipient on
    channel ``email``, in the transaction that uses the link up — a decision that is refused
    (it raises) leaves the link unused, and a second use decides nothing (``LinkUsed``).
    ``<kind>.link_used`` records who, signed in or not, and where the request came from."""
    link = link_get(kind, token)
    link_check_user(kind, link, user)
    actor = Actor.for_user(kind.recipient_of(link), EMAIL_CHANNEL)
    with transaction.atomic():
        # the conditional UPDATE serialises two uses of one link: the second matches nothing
        claimed = kind.model.objects.filter(id=link.id, used_at__isnull=True).update(used_at=Now())
        if claimed != 1:
            raise LinkUsed("this link has already been used")
        subject = kind.subject_of(link)
        with checkpoint(subject.run_id, actor=actor.label, channel=actor.channel) as cp:
            cp.event(
                f"{kind.name}.link_used",
                link=link.id,
                by=actor.label,
                signed_in=user is not None and user.is_authenticated,
                client_ip=client_ip,
                user_agent=user_agent[:USER_AGENT_MAX],
                **kind.event_fields(link),
            )
        return act(link, actor)

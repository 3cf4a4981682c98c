"""Admin for auditors (issue 8): every model is here, and the record is read-only for
everyone, superusers included. State changes happen only as admin actions that call the
services (``run_terminate``, ``run_retry_recovery``, ...), which check permission and append a
run event naming the actor with channel ``admin``.

Built for 100,000 runs and 1,000,000 events: no per-row queries (``list_select_related``,
columns that read only the row), capped counts instead of full table counts, list filters that
need no ``SELECT DISTINCT`` over big tables, and exact-match search that uses the indexes.

A module for what each part serves: ``base`` (the read-only base classes, the capped
paginator) and ``filters``, then ``runs`` (runs and steps, and the actions on runs),
``toolcalls``, ``events`` (run events and the audit log), ``waits``, ``messages`` (outbox,
webhooks, alerts), ``api`` (tokens, idempotent requests, remote agents), ``limits`` (flow
control), ``spend`` (spend caps), ``workers`` (and django-q2's models, kept out), ``accounts`` (users, groups, sign-in
lockouts). Importing the package registers them all (Django's admin autodiscovery).
"""

from __future__ import annotations

from runs.admin import (  # noqa: F401  (each module registers its models)
    accounts,
    api,
    events,
    limits,
    messages,
    runs,
    spend,
    toolcalls,
    waits,
    workers,
)
from runs.admin.base import AuditAdmin, CappedCountPaginator, ReadOnlyAdmin, run_link
from runs.admin.filters import ChannelFilter, EffectFilter, ToolFilter

__all__ = [
    "AuditAdmin",
    "CappedCountPaginator",
    "ChannelFilter",
    "EffectFilter",
    "ReadOnlyAdmin",
    "ToolFilter",
    "run_link",
]

"""What the checkpoint and its two backends share: the run fields a checkpoint reads; rows
inserted in one commit that reference each other (a tool call its step, a receipt its call)
— a foreign key assigned to an object that was still unsaved is filled in from it once it
has its key; and which runs a worker (hosted) or an agent process (remote) may claim."""

from __future__ import annotations

from collections.abc import Callable
from functools import cache
from typing import Any, cast

from django.db import DatabaseError, models
from django.db.models import Q
from django.db.models.fields.related import RelatedField
from django.db.models.functions import Now

from runs.models import AgentManifest, Run

# the run's fields a locking checkpoint reads
LOCKED_FIELDS = (
    "id",
    "status",
    "fence",
    "event_seq",
    "last_event_hash",
    # copied into every event (RunEvent.run_created_at: the events' partition key)
    "created_at",
    "requested_action",
    "requested_by",
    "requested_reason",
    "trace_id",
    "root_run_id",
    "agent_name",
    "agent_version",
    "principal_id",
    # budget limits: an operator may raise them under a live lease (run_topup_budget)
    "max_steps",
    "max_cost",
    "max_tokens",
    "deadline",
)

# What others may change while a worker holds the lease (an operator's request, budget limits
# an operator may raise): every checkpoint reads them back — from the locked row, or from the
# RETURNING of the write that does not lock (``checkpoint(expect=...)``).
LIVE_FIELDS = (
    "requested_action",
    "requested_by",
    "requested_reason",
    "max_steps",
    "max_cost",
    "max_tokens",
    "deadline",
)


@cache
def relations(model: type[models.Model]) -> tuple[RelatedField, ...]:
    """The model's concrete foreign keys (asked at every insert of every step: once per
    model)."""
    return tuple(f for f in model._meta.concrete_fields if isinstance(f, RelatedField))


def links(obj: models.Model, earlier: list[models.Model]) -> list[tuple[models.Field, int]]:
    """Foreign keys of ``obj`` that point at an object inserted before it in the same
    checkpoint: (the field, that object's index)."""
    found: list[tuple[models.Field, int]] = []
    if not earlier:
        return found
    for model_field in relations(type(obj)):
        if model_field.is_cached(obj):
            target = model_field.get_cached_value(obj)
            for index, other in enumerate(earlier):
                if other is target:
                    found.append((model_field, index))
    return found


def link(obj: models.Model, inserts: list[models.Model]) -> None:
    for model_field, index in links(obj, inserts[: inserts.index(obj)]):
        setattr(obj, model_field.attname, inserts[index].pk)
        # setting the key drops the cached object: keep it (no query to read it back); a
        # field links() found is a relation
        cast(RelatedField, model_field).set_cached_value(obj, inserts[index])


def link_saved(obj: models.Model) -> None:
    """Fill in a foreign key assigned while its target was unsaved, once the target has its
    key (it was written earlier in the same checkpoint, before a read)."""
    for model_field in relations(type(obj)):
        if model_field.is_cached(obj):
            target = model_field.get_cached_value(obj)
            unset = getattr(obj, model_field.attname) is None
            if unset and target is not None and target.pk is not None:
                setattr(obj, model_field.attname, target.pk)
                model_field.set_cached_value(obj, target)


def kind_filter(remote: bool) -> Q:
    """Remote agents' runs are advanced only by agent processes through the API
    (``runs.remote``), hosted ones only by workers: neither may claim the other's."""
    remote_names = Q(agent_name__in=AgentManifest.objects.values("name"))
    return remote_names if remote else ~remote_names


def claimable() -> Q:
    """Which runs a worker may claim (lease aside): runnable ones, and waiting ones whose
    timer or timeout fell due (docs/waits.md). A wait with no timeout has ``wake_at`` null
    and is never claimed until a signal or an answer makes it runnable."""
    return Q(status__in=Run.RUNNABLE) | Q(
        status=Run.Status.WAITING_EVENT, wake_at__isnull=False, wake_at__lte=Now()
    )


def write_rows(cp: Any, insert: Callable[[Any], Any], update: Callable[..., int]) -> None:
    """A checkpoint's collected rows, one statement each, through a backend's ``insert``
    and ``update`` (in order: a row may reference one inserted before it)."""
    for obj in cp.inserts:
        link(obj, cp.inserts)
        insert(obj)
    for model, pk, values in cp.row_updates:
        if update(model, pk, **values) != 1:
            raise DatabaseError(f"{model.__name__} {pk} is gone: not updated")

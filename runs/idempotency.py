"""Retry-safe run creation: ``POST /api/v1/runs/`` with an ``Idempotency-Key``.

A client that lost the response to its create request sends it again with the same key and
gets the same run back, never a second run. The key record and the run are written in one
transaction, so a crash between them leaves neither; two concurrent requests with one key
race on the unique constraint and the loser returns the winner's run.
"""

from __future__ import annotations

from typing import Any

from django.db import IntegrityError, transaction

from runs.actors import Actor
from runs.errors import DomainError
from runs.models import IdempotentRequest, Run
from runs.registry import digest
from runs.services import run_create


class IdempotencyKeyReused(DomainError):
    code = "idempotency_key_reused"
    status = 409


def request_digest(body: Any) -> str:
    """Key order and whitespace do not make two bodies different."""
    return digest(body)


def _replay(*, principal: Any, key: str, body_digest: str) -> Run | None:
    previous = (
        IdempotentRequest.objects.select_related("run").filter(principal=principal, key=key).first()
    )
    if previous is None:
        return None
    if previous.request_digest != body_digest:
        raise IdempotencyKeyReused(
            "this Idempotency-Key was already used with a different request body"
        )
    return previous.run


def run_create_idempotent(
    *, key: str, body: Any, actor: Actor, **create_kwargs: Any
) -> tuple[Run, bool]:
    """``(run, created)``. Keys are scoped to the acting principal: two tokens of one
    service account share keys, two different accounts never collide."""
    principal = actor.user
    if principal is None:
        raise ValueError("idempotency keys belong to a principal")
    body_digest = request_digest(body)
    run = _replay(principal=principal, key=key, body_digest=body_digest)
    if run is not None:
        return run, False
    try:
        with transaction.atomic():
            run = run_create(actor=actor, **create_kwargs)
            IdempotentRequest.objects.create(
                principal=principal, key=key, request_digest=body_digest, run=run
            )
    except IntegrityError:
        # a concurrent request with the same key won; our run rolled back with the key row
        run = _replay(principal=principal, key=key, body_digest=body_digest)
        if run is None:
            raise
        return run, False
    return run, True

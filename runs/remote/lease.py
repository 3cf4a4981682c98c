"""The lease a remote agent process holds: claimed with the engine's compare-and-set
(``remote_lease_acquire``, with the resume checks), rebuilt from the record for every
write (``_held``: ``LeaseLost`` unless the fence is current and live), heartbeated,
released, and expired by the sweeper (``remote_leases_expire``)."""

from __future__ import annotations

import hmac
import secrets
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime
from typing import Any, ClassVar, cast

from django.conf import settings
from django.db import connection
from django.db.models.expressions import RawSQL
from django.db.models.functions import Now

from runs import engine
from runs.actors import DRIVE_REMOTE_RUN, Actor
from runs.dbtime import db_now
from runs.errors import DomainError
from runs.models import Run, Step, ToolCall
from runs.record import configcache
from runs.record.checkpoint import LeaseLost, RunNotFound, checkpoint
from runs.record.common import kind_filter
from runs.record.runs import WAITING_FOR_PROCESS, run_lease_expired
from runs.registry import registry
from runs.remote.manifest import RemoteAgent, is_remote
from runs.remote.resume import resume_packet
from runs.services import BudgetExhausted, InvalidState
from runs.tokens import token_hash


class LeaseHeld(InvalidState):
    code = "lease_held"
    status = 409


class LeaseNotYours(DomainError):
    """A fenced write whose lease token (or principal) is not the current claim's: someone
    who learned the fence (every viewer sees it in the run's events) is not its holder."""

    code = "lease_not_yours"
    status = 403


@dataclass
class RemoteLease(engine.Lease):
    """The engine's ``Lease`` for an agent process: events name the API actor, and every
    write also requires the run still to be ``running`` (a released or expired lease keeps
    its fence until the next claim)."""

    RECOVERY_COUNTED_AT_CLAIM: ClassVar[bool] = False

    @property
    def actor(self) -> str:
        return self.worker

    @contextmanager
    def checkpoint(self, *, locked: Run | None = None):
        # always locks before the body (no ``expect``): every write checks the row
        with checkpoint(
            self.run.id, actor=self.actor, channel="api", fence=self.fence, locked=locked
        ) as cp:
            if cp.run.status != Run.Status.RUNNING:
                raise LeaseLost(
                    f"run {self.run.id} is {cp.run.status}: this lease was released; claim it again"
                )
            yield cp
        self.take_operator_changes(cp.run)


def _owner(actor: Actor, owner: str) -> str:
    return f"{actor.label}#{owner}"[:200] if owner else actor.label[:200]


def _require_remote(run_id: Any, actor: Actor) -> Run:
    """The run, if it is a remote agent's and ``actor`` may drive it (``require_driver``):
    every request of the protocol starts here."""
    actor.require(DRIVE_REMOTE_RUN)  # before anything is read: a stranger learns nothing
    run = Run.objects.filter(id=run_id).only("id", "agent_name").first()
    if run is None:
        raise RunNotFound(f"run {run_id} does not exist")
    if not is_remote(run.agent_name):
        raise InvalidState(
            f"{run.agent_name} is a hosted agent: its runs are advanced by workers, not leased"
        )
    actor.require_driver(run.agent_name)
    return run


def _token_matches(run: Run, lease_token: str) -> bool:
    # constant time: the comparison must not tell a prober how much of a guess was right
    return bool(run.lease_token_hash) and hmac.compare_digest(
        run.lease_token_hash, token_hash(lease_token or "")
    )


def holder_conditions(actor: Actor, lease_token: str) -> tuple[str, Any]:
    """``_prove_holder`` and ``require_driver``'s ownership as conditions on the run's row,
    for a check that must be one query (the pre-send check): the token's hash and the
    principal's user id (``runs.record.rows.presend_row``)."""
    return token_hash(lease_token or ""), getattr(actor.user, "pk", None)


def _prove_holder(run: Run, fence: int, actor: Actor, lease_token: str) -> None:
    """``LeaseNotYours`` unless the caller is the principal the claim of ``fence`` answered
    and presents its token. A fence that is not the run's current one is left to the
    caller's ``LeaseLost`` (a zombie of an earlier incarnation is told its lease is gone)."""
    if run.fence != fence:
        return
    if not _token_matches(run, lease_token) or run.lease_holder_id != getattr(
        actor.user, "pk", None
    ):
        raise LeaseNotYours(
            f"fence {fence} of run {run.id} was claimed by another principal or process: "
            "present the lease_token the claim returned"
        )


def lease_holder_check(run_id: Any, fence: int, actor: Actor, lease_token: str) -> None:
    """For the protocol's answers that write nothing (a retried request answered from the
    record, the pre-send check): the same proof ``_held`` asks for, whatever the run's
    status now."""
    run = (
        Run.objects.filter(id=run_id)
        .only("id", "fence", "lease_token_hash", "lease_holder")
        .first()
    )
    if run is not None:
        _prove_holder(run, fence, actor, lease_token)


def is_lease_holder(user: Any, run: Run) -> bool:
    """Whether ``user`` holds ``run``'s live remote lease (the one principal that receives
    the unmasked arguments of its calls). A hosted run's lease belongs to a worker: False."""
    return (
        user is not None
        and getattr(user, "pk", None) is not None
        and run.lease_holder_id == user.pk
        and run.status == Run.Status.RUNNING
        and run.lease_expires_at is not None
        and run.lease_expires_at > db_now()
    )


def _held(run_id: Any, fence: int, actor: Actor, lease_token: str) -> RemoteLease:
    """The caller's lease, rebuilt from the record; ``LeaseLost`` unless ``fence`` is the
    current incarnation's and its lease is live, ``LeaseNotYours`` unless the caller is the
    principal that claimed it and presents the claim's token."""
    _require_remote(run_id, actor)
    run = (
        Run.objects.select_related("principal")
        .filter(id=run_id, fence=fence, status=Run.Status.RUNNING, lease_expires_at__gt=Now())
        # a remote lease is held across many requests: each reads the configuration's
        # generations, as a claim does, in this same query
        .annotate(config_generation=RawSQL(configcache.generation_sql(connection.vendor), ()))
        .first()
    )
    if run is None:
        raise LeaseLost(f"fence {fence} does not hold run {run_id}'s lease; claim it again")
    configcache.note(run.config_generation)
    _prove_holder(run, fence, actor, lease_token)
    return RemoteLease(
        run=run,
        fence=fence,
        # events name who wrote (the holder's principal), with the process name it claimed as
        worker=_owner(actor, run.lease_owner.partition("#")[2]),
        recovered=False,
        agent=registry.agent(run.agent_name),
        steps=list(Step.objects.filter(run_id=run_id).order_by("seq")),
        claimed_db_time=db_now(),
    )


def honour_request(lease: RemoteLease) -> None:
    """An operator asked to pause or terminate while this process held the lease: honoured
    at this boundary (after any receipt), and the process is told its lease is gone."""
    if not lease.run.requested_action:
        return
    action, by = lease.run.requested_action, lease.run.requested_by
    if engine.honour_request(lease):
        raise LeaseLost(f"{by} asked to {action} the run: the lease is released")


def _check_budget(lease: RemoteLease) -> None:
    exhausted = engine.budget_exhausted(lease)
    if exhausted:
        engine.park_needs_attention(lease, Run.Reason.BUDGET_EXHAUSTED, exhausted)
        raise BudgetExhausted(exhausted + "; the run now needs a person (top up its budget)")


def _open_step_call(lease: RemoteLease) -> tuple[Step, ToolCall] | None:
    step = lease.open_step()
    if step is None or step.kind != Step.Kind.TOOL_CALL:
        return None
    return step, ToolCall.objects.select_related("step").get(step=step)


def _settle_open_step(lease: RemoteLease) -> None:
    """At claim, as the engine does in ``_continue_step``: a call that settled (a receipt, a
    rejection, a cancellation) ends its step from the record whatever was deployed since; a
    retired or changed tool follows the engine's rules for the calls still open; a call left
    in flight by an earlier incarnation becomes ``unknown`` (never silently dispatched
    again), and an ``unsafe`` unknown outcome goes to a person. An open wait (claimed
    because its timer or timeout fell due before the sweeper ended it) ends here as the
    engine's ``continue_wait`` ends it, or parks again."""
    step = lease.open_step()
    if step is not None and step.kind == Step.Kind.WAIT:
        engine.continue_wait(lease, step)
        return
    found = _open_step_call(lease)
    if found is None:
        return
    step, call = found
    done, tool = engine.open_call(lease, step, call)
    if done is not None:
        return
    # open_call handled a tool retired or changed (tool_changed): here the tool is deployed
    assert tool is not None
    if call.status == ToolCall.Status.DISPATCHING:
        engine.mark_unknown(
            lease, call, f"left in dispatching by incarnation {call.dispatch_incarnation}"
        )
    if (
        call.status == ToolCall.Status.UNKNOWN
        and engine.unknown_needs_person(tool)
        and not call.redispatch_authorized  # an operator chose "dispatch again" already
    ):
        engine.park_unknown_outcome(lease, call)


@dataclass(frozen=True)
class LeaseGrant:
    run_id: Any
    fence: int
    lease_expires_at: datetime
    resume: dict[str, Any]
    # shown once, here; the record keeps only its hash
    lease_token: str

    @property
    def lease_ttl_seconds(self) -> float:
        return float(settings.AGENTOPS["LEASE_TTL"])


def remote_lease_acquire(*, run_id: Any, actor: Actor, owner: str = "") -> LeaseGrant:
    """Claim a remote run's lease with the engine's compare-and-set. ``LeaseHeld`` when
    another process holds a live lease; ``InvalidState`` when the run is not runnable. The
    resume checks of DESIGN §5 run here, before the process decides anything."""
    _require_remote(run_id, actor)
    lease_token = secrets.token_urlsafe(32)

    def bind_to_caller(run: Run, recovered: bool) -> None:
        # in the claim's own transaction, on the row its UPDATE locked: no moment exists
        # in which the new fence is current with an earlier holder's token
        Run.objects.filter(id=run.id, fence=run.fence).update(
            lease_token_hash=token_hash(lease_token), lease_holder=actor.user
        )

    lease = engine.claim(
        run_id,
        worker=_owner(actor, owner),
        remote=True,
        lease_type=RemoteLease,
        on_claimed=bind_to_caller,
    )
    if lease is None:
        run = Run.objects.get(id=run_id)
        if run.status == Run.Status.RUNNING and run.lease_expires_at is not None:
            raise LeaseHeld(
                f"{run.lease_owner} holds the lease until {run.lease_expires_at.isoformat()}"
            )
        raise InvalidState(f"the run is {run.status}; only a queued or running run is leased")
    lease = cast(RemoteLease, lease)
    if lease.run.reason_detail == WAITING_FOR_PROCESS:
        with lease.checkpoint() as cp:
            cp.update(reason_detail="")
    migrated_from = lease.run.agent_version
    if not engine.resume_checks(lease):
        _settle_open_step(lease)
    run = Run.objects.get(id=run_id)
    if run.status == Run.Status.WAITING_EVENT:
        raise InvalidState(
            "the run is waiting_event: nothing has ended its wait yet (the run.wait_ended "
            "webhook says when something does)"
        )
    if run.status != Run.Status.RUNNING or run.fence != lease.fence:
        raise InvalidState(
            f"the run is {run.status} ({run.reason_code}): {run.reason_detail}".strip(": ")
        )
    packet = resume_packet(run)
    # a remote run's agent is its manifest's (runs.remote.manifest), whose hops carry notes
    if isinstance(lease.agent, RemoteAgent) and migrated_from != run.agent_version:
        packet["migrated_from"] = migrated_from
        packet["migrations"] = [
            {"from": source, "to": target, "description": lease.agent.migration_notes.get(source)}
            for source, target, _fn in lease.agent.migration_path(migrated_from) or []
        ]
    # the claim above set it (this fence's lease, checked just now)
    assert run.lease_expires_at is not None
    return LeaseGrant(
        run_id=run.id,
        fence=run.fence,
        lease_expires_at=run.lease_expires_at,
        resume=packet,
        lease_token=lease_token,
    )


def remote_lease_heartbeat(*, run_id: Any, fence: int, lease_token: str, actor: Actor) -> Run:
    """Extend the lease by its TTL. Pause and terminate requests are reported
    (``requested_action``), to be honoured after any call in flight has its receipt."""
    lease = _held(run_id, fence, actor, lease_token)
    with lease.checkpoint() as cp:
        cp.update(lease_expires_at=engine.lease_expiry())
    return Run.objects.get(id=run_id)


def remote_lease_release(*, run_id: Any, fence: int, lease_token: str, actor: Actor) -> Run:
    """Give the lease back; the run waits (``queued``) for an agent process."""
    lease = _held(run_id, fence, actor, lease_token)
    if not engine.honour_request(lease):
        engine.release(lease)
    return Run.objects.get(id=run_id)


# --- expiry (a sweep hook) -----------------------------------------------------------------------


def remote_leases_expire(limit: int = 200) -> int:
    """Remote runs whose process stopped heartbeating go back to ``queued``, waiting for an
    agent process, with ``run.lease_expired`` (and its webhook). Counted as a recovery."""
    expired = list(
        Run.objects.filter(
            kind_filter(remote=True),
            status=Run.Status.RUNNING,
            lease_expires_at__lt=Now(),
        ).values_list("id", "fence", "lease_owner")[:limit]
    )
    count = 0
    for run_id, fence, owner in expired:
        with checkpoint(run_id, actor="system", channel="worker") as cp:
            still = Run.objects.filter(
                id=run_id, fence=fence, status=Run.Status.RUNNING, lease_expires_at__lt=Now()
            ).exists()
            if not still:  # renewed or claimed again since we looked
                continue
            run_lease_expired(cp, owner=owner, fence=fence)
            count += 1
    return count

"""A remote agent's durable waits (docs/waits.md, docs/remote-agents.md): begun by the process
(``remote_wait_begin``), ended by whatever arrives or falls due (``remote_wait_end``,
``remote_waits_end_due``), with the run queued for an agent process."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from django.db.models.functions import Now
from django.utils import timezone

from runs import engine, waitrules
from runs.actors import Actor
from runs.dbtime import db_now
from runs.models import Question, Run, Step
from runs.record.checkpoint import Checkpoint, checkpoint
from runs.record.common import kind_filter
from runs.record.runs import WAITING_FOR_PROCESS, run_queue
from runs.registry import Agent, AskQuestion, Sleep, UnknownAgent, WaitForSignal, registry
from runs.remote.lease import (
    _check_budget,
    _held,
    _require_remote,
    honour_request,
    lease_holder_check,
)
from runs.remote.resume import wait_outcomes
from runs.remote.steps import _next_seq, _replayed_step
from runs.services import InvalidInput, InvalidState

WAIT_KINDS = ("signal", "timer", "question")


@dataclass(frozen=True)
class WaitBegun:
    step: Step
    waiting: bool  # parked: the lease is released until something ends the wait
    question_id: int | None
    outcome: dict[str, Any] | None  # how it ended, when it ended at once (else None)
    replayed: bool = False  # a retried request: the wait its first attempt began


def _wait_begun(step: Step, *, replayed: bool) -> WaitBegun:
    question_id = (
        Question.objects.filter(step=step).values_list("id", flat=True).first()
        if step.input.get("wait") == "question"
        else None
    )
    return WaitBegun(
        step=step,
        waiting=step.status == Step.Status.PENDING,
        question_id=question_id,
        outcome=wait_outcomes([step]).get(step.id),
        replayed=replayed,
    )


def _same_wait(step: Step, action: WaitForSignal | Sleep | AskQuestion) -> bool:
    # deadlines are computed from the clock at the time of the request: not compared
    spec, _wake_at = waitrules.spec(action, timezone.now())
    volatile = ("deadline", "until")
    return {k: v for k, v in step.input.items() if k not in volatile} == {
        k: v for k, v in spec.items() if k not in volatile
    }


def remote_wait_begin(
    *,
    run_id: Any,
    fence: int,
    lease_token: str,
    actor: Actor,
    action: WaitForSignal | Sleep | AskQuestion,
    seq: int | None = None,
) -> WaitBegun:
    """A remote agent's durable wait, through the engine's own ``decide_wait``: the wait
    step (``decided``), its question (emailed after the commit), and — unless the wait can
    end at once — ``run.waiting`` with the run parked in ``waiting_event``, ``wake_at`` set
    and the lease released, all in one commit. A signal that arrived before the wait began,
    or a time already come, ends it in that same commit: the lease is then still the
    process's and ``outcome`` says how it ended.

    An invalid wait is ``InvalidInput`` and writes nothing (a hosted agent gets a failed
    step instead: a process can correct its request). ``seq`` (optional) makes a retry safe
    as for steps: the same wait at that seq by this incarnation is returned as it stands."""
    if not isinstance(action, WaitForSignal | Sleep | AskQuestion):
        raise InvalidInput("a wait is a signal, a timer or a question")
    if seq is not None:
        _require_remote(run_id, actor)
        lease_holder_check(run_id, fence, actor, lease_token)
        replayed = _replayed_step(
            run_id, fence, seq, Step.Kind.WAIT, lambda step: _same_wait(step, action)
        )
        if replayed is not None:
            return _wait_begun(replayed, replayed=True)
    error = waitrules.validate(action)
    if error:
        raise InvalidInput(error)
    lease = _held(run_id, fence, actor, lease_token)
    if isinstance(action, AskQuestion):
        actor.require_question_to(lease.run.agent_name, action.group)
    honour_request(lease)
    if lease.open_step() is not None:
        raise InvalidState("a tool call is still open: record its receipt before waiting")
    seq = _next_seq(lease, seq)
    _check_budget(lease)
    engine.decide_wait(lease, action, seq)
    return _wait_begun(lease.steps[-1], replayed=False)


def remote_wait_end(cp: Checkpoint, *, step: Step, agent: Agent) -> bool:
    """End a remote run's wait inside ``cp`` (the run row locked, no lease held), if what
    arrived or the clock allows it. No worker ever claims a remote run, so whatever ends its
    wait ends it right there — a signal or an answer in the service's own commit
    (``runs.waits``), the timer or the timeout in the sweeper's (``remote_waits_end_due``) —
    exactly as the engine ends a hosted run's wait at claim (``waitrules.end_wait_if_due``):
    the step completes with its outcome, a signal is consumed in the same commit, and
    ``run.wait_ended`` or ``run.wait_timed_out`` is recorded (its webhook, ``run.wait_ended``,
    wakes a process that exited). The run is then ``queued``, waiting for an agent process,
    whose next lease finds the finished wait in its resume packet."""
    run = Run.objects.get(id=cp.run.id)
    if not waitrules.end_wait_if_due(cp, run=run, agent=agent, step=step, now=db_now()):
        return False
    run_queue(cp, enqueue=False, wake_at=None, enqueued_at=None, reason_detail=WAITING_FOR_PROCESS)
    return True


def remote_waits_end_due(limit: int = 200) -> int:
    """A sweep hook: remote runs whose timer or wait timeout fell due (``wake_at``, database
    time) have their wait ended (``remote_wait_end``) — also timers that fell due while no
    sweeper ran. Returns how many waits ended."""
    due = list(
        Run.objects.filter(
            kind_filter(remote=True),
            status=Run.Status.WAITING_EVENT,
            wake_at__lte=Now(),
        ).values_list("id", "agent_name")[:limit]
    )
    ended = 0
    for run_id, agent_name in due:
        try:
            agent = registry.agent(agent_name)
        except UnknownAgent:
            continue
        with checkpoint(run_id, actor="system", channel="worker") as cp:
            still = Run.objects.filter(
                id=run_id, status=Run.Status.WAITING_EVENT, wake_at__lte=Now()
            ).exists()
            if not still:  # ended, claimed or terminated since we looked
                continue
            step = waitrules.open_wait_step(run_id)
            if step is not None and remote_wait_end(cp, step=step, agent=agent):
                ended += 1
    return ended

"""Durable waits (docs/waits.md): signals, timers and questions to people.

An agent's ``decide`` returns ``WaitForSignal``, ``Sleep`` or ``AskQuestion``. The engine
records a ``wait`` step and, unless the wait can end at once, parks the run in
``waiting_event`` with no lease and ``wake_at`` = the timer or timeout: no worker is held,
however long the wait. Everything that ends a wait is in the database:

- a ``Signal`` row (``run_signal``), kept until a wait for its name consumes it, so one sent
  before the wait began is not lost;
- a ``Question`` answered (``question_answer``), first valid answer wins;
- ``wake_at`` falling due: ``claimable()`` lets a worker claim the run, and the sweeper
  enqueues it, including timers that fell due while no worker ran.

Services here (``run_signal``, ``question_answer``) lock the run like every other service
(``checkpoint``) and make a waiting run runnable; they never end a hosted run's wait
themselves. The engine ends it (``end_wait_if_due``) in its own fenced commit, where the
signal's consumption and the step's completion share one transaction: consumed exactly once,
across crashes. A remote agent's run has no worker to do that: its wait ends in the
service's own commit, with the same function (``runs.remote.remote_wait_end``).
"""

from __future__ import annotations

import json
from datetime import datetime, timedelta
from typing import Any

from django.db import transaction
from django.db.models import Q
from django.db.models.functions import Now
from django.utils import timezone

from runs import links, notify
from runs.actors import Actor, PermissionDenied
from runs.dbtime import db_now
from runs.models import Question, QuestionLink, Run, Signal, Step
from runs.record import transitions
from runs.record.checkpoint import Checkpoint, checkpoint
from runs.record.eventtypes import EventType
from runs.record.runs import run_await_event, run_queue
from runs.registry import (
    Agent,
    AskQuestion,
    Sleep,
    UnknownAgent,
    WaitForSignal,
    digest,
    registry,
)
from runs.services import InvalidInput, InvalidState

SIGNAL_NAME_MAX = 100
ANSWER_MAX = 4000


class AlreadyAnswered(InvalidState):
    """The question was answered already (the first valid answer wins)."""

    code = "already_decided"
    status = 409


class QuestionClosed(InvalidState):
    """The question expired or was cancelled: the agent goes on without an answer."""


class SignalKeyReused(InvalidState):
    code = "idempotency_key_reused"
    status = 409


def claimable() -> Q:
    """Which runs a worker may claim (lease aside): runnable ones, and waiting ones whose
    timer or timeout fell due. A wait with no timeout has ``wake_at`` null and is never
    claimed until a signal or an answer makes it runnable."""
    return Q(status__in=Run.RUNNABLE) | Q(
        status=Run.Status.WAITING_EVENT, wake_at__isnull=False, wake_at__lte=Now()
    )


# --- the engine's side ------------------------------------------------------------------------


def validate(action: WaitForSignal | Sleep | AskQuestion) -> str:
    """Why the engine refuses this wait (recorded as a failed step the agent sees); empty
    when it is valid."""
    if isinstance(action, WaitForSignal):
        if not isinstance(action.name, str) or not action.name.strip():
            return "a signal wait needs a name"
        if len(action.name) > SIGNAL_NAME_MAX:
            return f"a signal name has at most {SIGNAL_NAME_MAX} characters"
        if action.timeout_seconds is not None and action.timeout_seconds < 0:
            return "timeout_seconds must not be negative"
        return _json_error("default", action.default)
    if isinstance(action, Sleep):
        if (action.until is None) == (action.seconds is None):
            return "Sleep needs exactly one of until and seconds"
        if action.until is not None and timezone.is_naive(action.until):
            return "Sleep(until=...) needs a timezone-aware datetime"
        if action.seconds is not None and action.seconds < 0:
            return "Sleep(seconds=...) must not be negative"
        return ""
    if not isinstance(action.text, str) or not action.text.strip():
        return "a question needs text"
    if action.ttl_seconds is None or action.ttl_seconds <= 0:
        return "a question needs a positive ttl_seconds"
    if not isinstance(action.group, str) or not action.group:
        return "a question needs a group of people who may answer it"
    from django.contrib.auth.models import Group

    if not Group.objects.filter(name=action.group).exists():
        return f"no group named {action.group!r}: nobody could answer"
    if action.choices is not None:
        choices = list(action.choices)
        if not choices or not all(isinstance(c, str) and c for c in choices):
            return "choices must be a non-empty list of non-empty strings"
        if len(set(choices)) != len(choices):
            return "choices must be distinct"
        if action.default is not None and action.default not in choices:
            return f"the default {action.default!r} is not one of the choices"
    return _json_error("default", action.default)


def _json_error(name: str, value: Any) -> str:
    try:
        json.dumps(value)
    except (TypeError, ValueError) as exc:
        return f"{name} is not JSON: {exc}"
    return ""


def spec(
    action: WaitForSignal | Sleep | AskQuestion, now: datetime
) -> tuple[dict, datetime | None]:
    """The step's input (what was decided, so a resumed run re-reads it, never re-asks) and
    when the run must be woken without anyone's help (None: only a signal or an answer)."""
    if isinstance(action, WaitForSignal):
        wake_at = (
            None
            if action.timeout_seconds is None
            else now + timedelta(seconds=action.timeout_seconds)
        )
        return {
            "wait": "signal",
            "name": action.name,
            "timeout_seconds": action.timeout_seconds,
            "default": action.default,
            "deadline": _iso(wake_at),
        }, wake_at
    if isinstance(action, Sleep):
        wake_at = (
            action.until if action.until is not None else now + timedelta(seconds=action.seconds)
        )
        return {"wait": "timer", "until": _iso(wake_at), "deadline": _iso(wake_at)}, wake_at
    wake_at = now + timedelta(seconds=action.ttl_seconds)
    return {
        "wait": "question",
        "text": action.text,
        "choices": list(action.choices) if action.choices is not None else None,
        "group": action.group,
        "ttl_seconds": action.ttl_seconds,
        "default": action.default,
        "deadline": _iso(wake_at),
    }, wake_at


def _iso(value: datetime | None) -> str | None:
    return value.isoformat() if value is not None else None


def deadline(step: Step) -> datetime | None:
    value = step.input.get("deadline")
    return datetime.fromisoformat(value) if value else None


def question_create(cp: Checkpoint, *, step: Step) -> Question:
    """Inside the wait's ``decided`` commit: the question exists exactly when its step does."""
    question = Question.objects.create(
        run_id=cp.run.id,
        step=step,
        text=step.input["text"],
        choices=step.input["choices"],
        group=step.input["group"],
        expires_at=deadline(step),
        default=step.input["default"],
    )
    cp.event(
        EventType.QUESTION_ASKED,
        question_id=question.id,
        seq=step.seq,
        group=question.group,
        choices=question.choices,
        expires_at=question.expires_at,
    )
    # the links commit with the question; the emails go out after the commit (runs.notify)
    notify.question_links_create_and_email(question=question)
    return question


def park(cp: Checkpoint, *, step: Step, again: bool = False) -> None:
    """The run waits with no lease held; ``wake_at`` brings it back at the timer or timeout.
    ``enqueued_at`` is cleared so the sweeper enqueues it as soon as that falls due."""
    wake_at = deadline(step)
    if not again:
        cp.event(
            EventType.RUN_WAITING,
            on=step.input["wait"],
            seq=step.seq,
            name=step.input.get("name"),
            wake_at=_iso(wake_at),
        )
        cp.boundary("waiting")
    else:
        cp.event(EventType.RUN_RELEASED, status=Run.Status.WAITING_EVENT, wake_at=_iso(wake_at))
    run_await_event(cp, wake_at=wake_at)


def end_wait_if_due(cp: Checkpoint, *, run: Run, agent: Agent, step: Step, now: datetime) -> bool:
    """Inside the lease holder's checkpoint (the run row locked): end the wait if a signal,
    an answer, the timer or the timeout allows it, completing the step in this commit.
    Returns whether it ended. ``now`` is database time."""
    kind = step.input["wait"]
    due = deadline(step)
    timed_out = due is not None and now >= due
    if kind == "signal":
        signal = (
            Signal.objects.filter(run_id=run.id, name=step.input["name"], consumed_at__isnull=True)
            .order_by("received_at", "id")
            .first()
        )
        if signal is not None:
            # consumption and completion commit together: a crash before this commit leaves
            # the signal unconsumed for the next incarnation, never consumed twice
            Signal.objects.filter(id=signal.id, consumed_at__isnull=True).update(
                consumed_at=timezone.now(), consumed_by_step=step
            )
            _end(cp, run, agent, step, signal.payload, ended_by="signal", signal_id=signal.id)
            return True
    elif kind == "question":
        question = Question.objects.get(step=step)
        if question.status == Question.Status.ANSWERED:
            _end(
                cp,
                run,
                agent,
                step,
                question.answer,
                ended_by="answer",
                question_id=question.id,
                answered_by=question.answered_by.get_username() if question.answered_by else None,
                channel=question.channel,
            )
            return True
        if question.status == Question.Status.OPEN and timed_out:
            question.status = Question.Status.EXPIRED
            question.save(update_fields=["status"])
            cp.event(EventType.QUESTION_EXPIRED, question_id=question.id, seq=step.seq)
    elif kind == "timer" and timed_out:
        _end(cp, run, agent, step, {"until": step.input["until"]}, ended_by="timer")
        return True
    if timed_out:
        cp.event(
            EventType.RUN_WAIT_TIMED_OUT,
            seq=step.seq,
            on=kind,
            name=step.input.get("name"),
            default=step.input.get("default"),
            timed_out=True,
        )
        transitions.complete_step(
            cp, run=run, agent=agent, step=step, ok=True, output=step.input.get("default"), error=""
        )
        return True
    return False


def _end(
    cp: Checkpoint, run: Run, agent: Agent, step: Step, output: Any, *, ended_by: str, **detail
) -> None:
    cp.event(
        EventType.RUN_WAIT_ENDED,
        seq=step.seq,
        on=step.input["wait"],
        ended_by=ended_by,
        timed_out=False,
        **detail,
    )
    transitions.complete_step(cp, run=run, agent=agent, step=step, ok=True, output=output, error="")


def open_wait_step(run_id: Any) -> Step | None:
    return (
        Step.objects.filter(run_id=run_id, kind=Step.Kind.WAIT, status=Step.Status.PENDING)
        .order_by("-seq")
        .first()
    )


def _wake(cp: Checkpoint, step: Step) -> None:
    """A waiting run becomes runnable at once: it never shows waiting after its wait can end.

    A remote agent's run is never claimed by a worker, so its wait ends here, in this commit,
    the way the engine would end it (``runs.remote.remote_wait_end``): the run is then
    queued for an agent process, and ``run.wait_ended`` (a webhook) tells the process."""
    try:
        agent = registry.agent(cp.run.agent_name)  # hosted agents: no query
    except UnknownAgent:
        agent = None
    if agent is not None and getattr(agent, "kind", "") == "remote":
        # runs.remote builds on this module and the engine: imported where it is used
        from runs.remote import remote_wait_end

        if remote_wait_end(cp, step=step, agent=agent):
            return
    run_queue(cp, wake_at=None)


# --- services ------------------------------------------------------------------------------------


def run_signal(
    *,
    run_id: Any,
    name: str,
    payload: Any = None,
    actor: Actor,
    idempotency_key: str | None = None,
) -> Signal:
    """Send the signal ``name`` to a run. Kept until a wait for that name consumes it (also
    when the run is not waiting yet); a waiting run is made runnable. The same
    ``idempotency_key`` again returns the first signal and delivers nothing more."""
    actor.require("runs.operate_run")
    if not isinstance(name, str) or not name.strip() or len(name) > SIGNAL_NAME_MAX:
        raise InvalidInput(f"a signal needs a name of 1 to {SIGNAL_NAME_MAX} characters")
    idempotency_key = idempotency_key or None
    if idempotency_key is not None and len(idempotency_key) > 200:
        raise InvalidInput("an idempotency key has at most 200 characters")
    if _json_error("payload", payload):
        raise InvalidInput(_json_error("payload", payload))
    # atomic() around the checkpoint: called inside a caller's transaction (an API request's,
    # a test's), a refusal rolls back to a savepoint and leaves that transaction usable
    with transaction.atomic(), checkpoint(run_id, actor=actor.label, channel=actor.channel) as cp:
        if idempotency_key is not None:
            # the run row is locked: two senders of one key are serialised here
            existing = Signal.objects.filter(run_id=run_id, idempotency_key=idempotency_key).first()
            if existing is not None:
                if existing.name != name or digest(existing.payload) != digest(payload):
                    raise SignalKeyReused(
                        "this idempotency key was already used for a different signal"
                    )
                return existing
        if cp.run.status in Run.TERMINAL:
            raise InvalidState(f"the run is {cp.run.status}: it will never read a signal")
        signal = Signal.objects.create(
            run_id=run_id,
            name=name,
            payload=payload,
            idempotency_key=idempotency_key or "",
            sent_by=actor.label,
            channel=actor.channel,
        )
        step = open_wait_step(run_id) if cp.run.status == Run.Status.WAITING_EVENT else None
        wakes = (
            step is not None and step.input.get("wait") == "signal" and step.input["name"] == name
        )
        cp.event(
            EventType.RUN_SIGNALLED,
            name=name,
            signal_id=signal.id,
            idempotency_key=idempotency_key,
            # the payload itself is on the signal row and the step's output; events may be
            # exported, and a signal's payload has no schema saying what is sensitive
            payload_digest=digest(payload),
            by=actor.label,
            delivered="waking" if wakes else "kept",
            seq=step.seq if wakes else None,
        )
        if wakes:
            _wake(cp, step)
    return signal


def may_answer(user: Any, question: Question) -> bool:
    if user is None or not user.is_authenticated or not user.is_active:
        return False
    return user.is_superuser or user.groups.filter(name=question.group).exists()


def question_answer(*, question_id: Any, answer: Any, actor: Actor) -> Question:
    """A person's answer. The first valid answer wins (a later one: ``AlreadyAnswered``);
    with choices it must be one of them; the actor must be in the question's group. The run
    is made runnable and its agent sees the answer as the wait step's output."""
    question = Question.objects.get(id=question_id)  # DoesNotExist
    if not may_answer(actor.user, question):
        raise PermissionDenied(f"{actor.label} is not in group {question.group}")
    if question.choices is not None:
        if answer not in question.choices:
            raise InvalidInput(f"the answer must be one of: {', '.join(question.choices)}")
    else:
        if not isinstance(answer, str) or not answer.strip():
            raise InvalidInput("write an answer")
        answer = answer.strip()
        if len(answer) > ANSWER_MAX:
            raise InvalidInput(f"an answer has at most {ANSWER_MAX} characters")
    with (
        transaction.atomic(),
        checkpoint(question.run_id, actor=actor.label, channel=actor.channel) as cp,
    ):
        question = Question.objects.select_related("step", "answered_by").get(id=question_id)
        if question.status == Question.Status.ANSWERED:
            who = question.answered_by.get_username() if question.answered_by else "someone"
            raise AlreadyAnswered(f"already answered by {who} via {question.channel}")
        if question.status != Question.Status.OPEN:
            raise QuestionClosed(f"the question is {question.status}")
        # database time, as for every expiry; the engine records the expiry when it wakes
        if question.expires_at <= db_now():
            raise QuestionClosed("the question expired; the agent goes on with its default")
        question.answer = answer
        question.answered_by = actor.user
        question.channel = actor.channel
        question.answered_at = timezone.now()
        question.status = Question.Status.ANSWERED
        question.save(update_fields=["answer", "answered_by", "channel", "answered_at", "status"])
        cp.event(
            EventType.QUESTION_ANSWERED,
            question_id=question.id,
            seq=question.step.seq,
            by=actor.label,
            channel=actor.channel,
            answer=answer,
        )
        if cp.run.status == Run.Status.WAITING_EVENT:
            _wake(cp, question.step)
    return question


# --- emailed question links (runs.notify) ---------------------------------------------------


# what a question link has of its own (runs.links holds the rest; its page:
# runs.views.question_link): it answers only for its recipient, signed in — never a bearer
# link
QUESTION_LINKS = links.register(
    links.LinkKind(
        name="question",
        model=QuestionLink,
        subject="question",
        recipient="recipient",
        related=("question__run", "question__step", "question__answered_by", "recipient"),
        login_required_message="sign in as the person this link was sent to, to answer",
        event_fields=lambda link: {"question_id": link.question_id},
    )
)


def question_link_get(token: str) -> QuestionLink:
    """The link this token belongs to, or ``runs.links.LinkInvalid``."""
    return links.link_get(QUESTION_LINKS, token)


def question_link_answer(
    *, token: str, answer: Any, user: Any = None, client_ip: str = "", user_agent: str = ""
) -> Question:
    """Answer through an emailed link (POST only), through ``runs.links.link_use``: the link
    is used up in the same transaction as the answer, so an answer that is refused (invalid,
    too late, already answered, the recipient no longer in the group) leaves it unused, and
    a second use answers nothing. The link's recipient is the actor, channel ``email``."""

    def answer_as(link: QuestionLink, actor: Actor) -> Question:
        return question_answer(question_id=link.question_id, answer=answer, actor=actor)

    return links.link_use(
        QUESTION_LINKS,
        token=token,
        user=user,
        act=answer_as,
        client_ip=client_ip,
        user_agent=user_agent,
    )

"""The engine's rules for durable waits (docs/waits.md): what a valid wait is, the wait step's
input and deadline, the question a wait asks, parking the run, and ending a wait whose signal,
answer, timer or timeout allows it — in the lease holder's commit (``runs.engine``) or, for a
remote run, in the commit of whatever ended it (``runs.remote.remote_wait_end``).

Below the engine and ``runs.remote``: it imports neither. The services that end waits
(``run_signal``, ``question_answer``) are above both, in ``runs.waits``.
"""

from __future__ import annotations

import json
from datetime import datetime, timedelta
from typing import Any

from django.utils import timezone

from runs import notify
from runs.models import Question, Run, Signal, Step
from runs.record import transitions
from runs.record.checkpoint import Checkpoint
from runs.record.eventtypes import EventType
from runs.record.runs import run_await_event
from runs.registry import Agent, AskQuestion, Sleep, WaitForSignal

SIGNAL_NAME_MAX = 100


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
        return json_error("default", action.default)
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
    return json_error("default", action.default)


def json_error(name: str, value: Any) -> str:
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

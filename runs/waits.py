"""Durable waits (docs/waits.md): signals, timers and questions to people — the services
that end them.

An agent's ``decide`` returns ``WaitForSignal``, ``Sleep`` or ``AskQuestion``. The engine
records a ``wait`` step and, unless the wait can end at once, parks the run in
``waiting_event`` with no lease and ``wake_at`` = the timer or timeout: no worker is held,
however long the wait (the engine's rules for it: ``runs.waitrules``). Everything that ends a
wait is in the database:

- a ``Signal`` row (``run_signal``), kept until a wait for its name consumes it, so one sent
  before the wait began is not lost;
- a ``Question`` answered (``question_answer``), first valid answer wins;
- ``wake_at`` falling due: ``runs.record.common.claimable()`` lets a worker claim the run,
  and the sweeper enqueues it, including timers that fell due while no worker ran.

Services here (``run_signal``, ``question_answer``) lock the run like every other service
(``checkpoint``) and make a waiting run runnable; they never end a hosted run's wait
themselves. The engine ends it (``runs.waitrules.end_wait_if_due``) in its own fenced commit,
where the signal's consumption and the step's completion share one transaction: consumed
exactly once, across crashes. A remote agent's run has no worker to do that: its wait ends in
the service's own commit, with the same function (``runs.remote.remote_wait_end``).

Above the engine and ``runs.remote``: nothing below imports this module.
"""

from __future__ import annotations

from typing import Any

from django.utils import timezone

from runs import links
from runs.actors import Actor, PermissionDenied
from runs.dbtime import db_now
from runs.models import Question, QuestionLink, Run, Signal, Step
from runs.record.checkpoint import Checkpoint
from runs.record.eventtypes import EventType
from runs.record.runs import run_queue
from runs.registry import UnknownAgent, digest, registry
from runs.remote import remote_wait_end
from runs.services import InvalidInput, InvalidState, service_checkpoint
from runs.waitrules import SIGNAL_NAME_MAX, json_error, open_wait_step

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


def _wake(cp: Checkpoint, step: Step) -> None:
    """A waiting run becomes runnable at once: it never shows waiting after its wait can end.

    A remote agent's run is never claimed by a worker, so its wait ends here, in this commit,
    the way the engine would end it (``runs.remote.remote_wait_end``): the run is then
    queued for an agent process, and ``run.wait_ended`` (a webhook) tells the process."""
    try:
        agent = registry.agent(cp.run.agent_name)  # hosted agents: no query
    except UnknownAgent:
        agent = None
    remote = agent is not None and getattr(agent, "kind", "") == "remote"
    if remote and remote_wait_end(cp, step=step, agent=agent):
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
    if json_error("payload", payload):
        raise InvalidInput(json_error("payload", payload))
    with service_checkpoint(run_id, actor=actor) as cp:
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
    with service_checkpoint(question.run_id, actor=actor) as cp:
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

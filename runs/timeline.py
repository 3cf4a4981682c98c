"""A run's story for people: its events grouped by incarnation (pure functions, no queries).

Every process that advances a run first claims its lease (``run.claimed``, the fence is the
incarnation number) and writes every later event under that fence, as ``worker:<name>``. An
incarnation ends when its worker releases the lease (``run.released``, waiting for a person,
finishing) — or it never ends cleanly: the process died or was partitioned, and the next
``run.claimed`` (``recovered: true``) takes over. The last event the dead incarnation
committed tells where it stopped, named by its checkpoint boundary (DESIGN §4).

Events written by people and the system outside any lease (an operator's pause, an
approval decision, a signal) form their own groups between incarnations, so an operator can
read "w-2 lost its lease at ``dispatching``; w-5 resumed at 14:03:07, reconciled call #4 →
succeeded" straight off the page.

The builder works on a window of events (the latest N, or an older page): a group cut by the
window's start is marked ``continued``, one cut by its end ``continues``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import TYPE_CHECKING, Any

from runs import jsonlimits
from runs.masking import UNMASKED, Masker
from runs.record.eventtypes import EventType
from runs.registry import call_summary

if TYPE_CHECKING:
    from runs.models import RunEvent

# Every event type the record holds (runs.record.eventtypes): the admin's filter and the
# console's event search offer these
EVENT_TYPES = sorted(EventType.values)


# Event types after which the worker that wrote them holds no lease any more.
_RELEASING = frozenset(
    {
        EventType.RUN_RELEASED,
        EventType.RUN_NEEDS_ATTENTION,
        EventType.RUN_PAUSED,
        EventType.RUN_SUCCEEDED,
        EventType.RUN_FAILED,
        EventType.RUN_TERMINATED,
        # waiting for an approval, a signal, a timer or an answer: the lease is released in
        # the same commit
        EventType.RUN_WAITING,
    }
)

# The checkpoint boundary (DESIGN §4) whose commit contains an event of this type: where a
# worker whose last commit held this event stopped.
_BOUNDARY = {
    EventType.RUN_CLAIMED: "claimed",
    EventType.RUN_MIGRATED: "claimed",
    EventType.RUN_MODEL_CHANGED: "claimed",
    EventType.STEP_DECIDED: "decided",
    EventType.APPROVAL_REQUESTED: "approval_requested",
    EventType.APPROVAL_CONSUMED: "dispatching",
    EventType.TOOL_DISPATCHING: "dispatching",
    EventType.TOOL_SUCCEEDED: "receipt_recorded",
    EventType.TOOL_FAILED: "receipt_recorded",
    EventType.STEP_FAILED: "step_completed",
    EventType.TOOL_UNKNOWN: "outcome unknown",
    EventType.TOOL_RECONCILE_ATTEMPTED: "reconciliation",
    EventType.RUN_WAITING: "waiting",
    EventType.RUN_WAIT_ENDED: "step_completed",
    EventType.RUN_WAIT_TIMED_OUT: "step_completed",
}


@dataclass
class Entry:
    """One event as a line of the timeline."""

    seq: int
    type: str
    actor: str
    channel: str
    at: datetime
    incarnation: int | None
    text: str
    payload: Mapping[str, Any]
    # the step a ``step.decided`` names (with its tool call and receipt), when loaded
    step: Any = None
    by_person: bool = False

    @classmethod
    def of(cls, event: RunEvent, payload: Mapping[str, Any], *, step: Any = None) -> Entry:
        """``event``'s line, showing ``payload`` (its payload, masked for the reader)."""
        return cls(
            seq=event.seq,
            type=event.type,
            actor=event.actor,
            channel=event.channel,
            at=event.created_at,
            incarnation=event.incarnation,
            text=describe(event.type, payload, event.actor),
            payload=payload,
            step=step,
            by_person=event.actor.startswith("user:"),
        )

    @property
    def payload_json(self) -> str:
        return jsonlimits.pretty(self.payload)


@dataclass
class Group:
    """One incarnation of the run (``kind == "incarnation"``) or events outside any lease
    (``kind == "outside"``)."""

    kind: str
    incarnation: int | None = None
    worker: str = ""
    recovered: bool = False
    # why this claim happened, e.g. "after the approval was decided" ("" for the first claim)
    cause: str = ""
    started_at: datetime | None = None
    entries: list[Entry] = field(default_factory=list)
    # how it ended: "released", "lost", "holding", "expired" or "" (still open / cut off)
    end: str = ""
    end_text: str = ""
    lost_at: str = ""  # the boundary of its last commit, when the lease was lost
    taken_over_by: str = ""  # the worker whose claim ended it
    notes: list[str] = field(default_factory=list)  # what it did that a person looks for
    continued: bool = False  # began before the window
    continues: bool = False  # goes on after the window
    closed: bool = False

    @property
    def title(self) -> str:
        if self.kind == "outside":
            return "Outside any lease"
        who = f"worker {self.worker}" if self.worker else "a worker"
        if self.continued:
            return f"Incarnation {self.incarnation} · {who} (earlier events not shown)"
        if self.recovered:
            return f"Incarnation {self.incarnation} · {who} took over after a lost lease"
        if self.cause:
            return f"Incarnation {self.incarnation} · {who} resumed the run {self.cause}"
        return f"Incarnation {self.incarnation} · {who} claimed the run"

    @property
    def summary(self) -> str:
        """One sentence: who, what it did that matters, how it ended."""
        parts: list[str] = []
        if self.kind == "incarnation" and not self.continued:
            when = f" at {self.started_at:%H:%M:%S}" if self.started_at else ""
            if self.recovered:
                parts.append(f"{self.worker} resumed{when} after a lost lease")
            elif self.cause:
                parts.append(f"{self.worker} resumed{when} {self.cause}")
            else:
                parts.append(f"{self.worker} claimed{when}")
        parts.extend(self.notes)
        if self.end_text:
            parts.append(self.end_text)
        return "; ".join(parts)


@dataclass(frozen=True)
class LeaseNow:
    """The run's lease as it is now, to tell "still holding" from "lost" for the last
    incarnation in the window."""

    owner: str
    fence: int
    live: bool


def _worker_of(actor: str) -> str:
    return actor.removeprefix("worker:") if actor.startswith("worker:") else ""


def _call(payload: Mapping[str, Any]) -> str:
    seq = payload.get("seq")
    tool = payload.get("tool")
    name = f" ({tool})" if tool else ""
    return f"call #{seq}{name}" if seq is not None else f"call{name}"


def _voided(voided: Any) -> str:
    """ "; voided: alice approved, bob approved" — decisions that no longer count."""
    if not isinstance(voided, list) or not voided:
        return ""
    said = {"approve": "approved", "reject": "rejected"}
    names = [
        f"{v.get('by')} {said.get(v.get('decision'), v.get('decision'))}"
        for v in voided
        if isinstance(v, Mapping)
    ]
    return "; voided (decide again): " + ", ".join(names) if names else ""


def describe(event_type: str, payload: Mapping[str, Any], actor: str = "") -> str:
    """A short human sentence for one event; unknown types fall back to their name."""
    p = payload
    by = p.get("by") or actor
    match event_type:
        case EventType.RUN_CREATED:
            principal = p.get("principal")
            on_behalf = f" for {principal}" if principal else ""
            text = f"created on {p.get('agent')} v{p.get('agent_version')}{on_behalf}"
            if p.get("dry_run"):
                text += " as a dry run (tools with side effects only simulated)"
            if p.get("promoted_from"):
                text += f", promoted from the dry run {p['promoted_from']}"
            return text
        case EventType.RUN_PROMOTED:
            return f"promoted by {by}: started for real as run {p.get('to_run')}"
        case EventType.RUN_CLAIMED:
            how = "took over after a lost lease" if p.get("recovered") else "claimed the lease"
            return f"{p.get('worker')} {how} (incarnation {p.get('fence')})"
        case EventType.RUN_RELEASED:
            wake = f", wakes at {p['wake_at']}" if p.get("wake_at") else ""
            return f"released the lease ({p.get('status')}{wake})"
        case EventType.RUN_MIGRATED:
            return f"state migrated from v{p.get('from')} to v{p.get('to')}"
        case EventType.RUN_MODEL_CHANGED:
            if p.get("by"):
                return f"model changed from {p.get('from')} to {p.get('to')} by {p['by']}"
            return f"model changed from {p.get('from')} to {p.get('to')} (agent follows its model)"
        case EventType.RUN_HANDED_OFF:
            to = ", ".join(map(str, p.get("to") or ()))
            return f"{p.get('worker')} handed the run to {to}: {p.get('reason')}"
        case EventType.RUN_MODEL_PINNED:
            return f"model pinned: {p.get('model')}"
        case EventType.STEP_DECIDED:
            kind = p.get("kind", "")
            what = f" → {p['tool']}" if p.get("tool") else ""
            refused = f" (refused: {p['refused']})" if p.get("refused") else ""
            return f"step #{p.get('seq')} decided: {kind}{what}{refused}"
        case EventType.STEP_FAILED:
            return f"step #{p.get('seq')} failed: {p.get('error', '')}"
        case EventType.TOOL_DISPATCHING:
            simulated = " (dry run: simulated, nothing sent)" if p.get("simulated") else ""
            return f"{_call(p)} dispatching{simulated}, attempt {p.get('attempt')}"
        case EventType.TOOL_SUCCEEDED | EventType.TOOL_FAILED:
            outcome = event_type.split(".")[1]
            ref = f", ref {p['external_ref']}" if p.get("external_ref") else ""
            return f"{_call(p)} → {outcome} (from {p.get('source', 'tool')}{ref})"
        case EventType.TOOL_UNKNOWN:
            error = f": {p['error']}" if p.get("error") else ""
            return f"{_call(p)} outcome unknown{error}"
        case EventType.TOOL_RECONCILE_ATTEMPTED:
            detail = f" ({p['detail']})" if p.get("detail") else ""
            return f"{_call(p)} looked up by key, attempt {p.get('attempt')}: {p.get('outcome')}{detail}"
        case EventType.TOOL_RESOLVED:
            risk = " (unsafe risk confirmed)" if p.get("confirmed_risk") else ""
            ref = f", ref {p['external_ref']}" if p.get("external_ref") else ""
            return f"{_call(p)} resolved as {p.get('outcome')} by {by}{ref}{risk}"
        case EventType.TOOL_CANCELLED:
            return f"{_call(p)} cancelled ({p.get('reason', '')})"
        case EventType.APPROVAL_REQUESTED:
            what = ""
            if p.get("tool") and isinstance(p.get("arguments"), Mapping):
                what = f": {call_summary(p['tool'], p['arguments'])}"
            minimums = p.get("from_groups") if isinstance(p.get("from_groups"), Mapping) else {}
            quota = ""
            if minimums:
                quota = (
                    " (at least "
                    + " and ".join(f"{n} from {g}" for g, n in sorted(minimums.items()))
                    + ")"
                )
            again = ""
            if p.get("replaces"):
                # asked again: which request it replaces, why, and whose decisions on it no
                # longer count (they do not carry over)
                again = f" — asked again, replacing #{p['replaces']}"
                if p.get("why"):
                    again += f" ({p['why']})"
                again += _voided(p.get("voided"))
            return (
                f"approval #{p.get('approval')} requested for {_call(p)} from {p.get('group')}"
                + quota
                + what
                + again
            )
        case EventType.APPROVAL_DECIDED:
            return f"approval #{p.get('approval')} {p.get('decision')} by {by}"
        case EventType.APPROVAL_CONSUMED:
            return f"approval for {_call(p)} consumed"
        case EventType.APPROVAL_CANCELLED if p.get("voided"):
            reason = f" ({p['reason']})" if p.get("reason") else ""
            return f"approval #{p.get('approval')} cancelled{reason}" + _voided(p["voided"])
        case EventType.APPROVAL_EXPIRED | EventType.APPROVAL_CANCELLED:
            return f"approval #{p.get('approval')} {event_type.split('.')[1]}"
        case EventType.RUN_WAITING:
            return f"waiting on {p.get('on')}" + (f" for {_call(p)}" if p.get("tool") else "")
        case EventType.RUN_NEEDS_ATTENTION:
            return f"needs attention: {p.get('reason')} — {p.get('detail', '')}"
        case EventType.RUN_PAUSED:
            reason = f": {p['reason']}" if p.get("reason") else ""
            return f"paused by {by}{reason}"
        case EventType.RUN_PAUSE_REQUESTED | EventType.RUN_TERMINATE_REQUESTED:
            action = event_type.split(".")[1].removesuffix("_requested")
            return f"{action} requested by {by}: {p.get('reason') or 'no reason given'}"
        case EventType.RUN_RESUMED:
            return f"resumed by {by}"
        case EventType.RUN_TERMINATED:
            return f"terminated by {by}: {p.get('reason', '')}"
        case EventType.RUN_BUDGET_TOPPED_UP:
            return f"budget topped up by {by}: {_limits_change(p)}"
        case EventType.RUN_RECOVERY_RETRIED:
            if p.get("reason") not in (None, "recovery_limit"):
                return f"retried by {by} after {p['reason']}"
            return f"recovery retried by {by} (recovered {p.get('recovery_count')} times so far)"
        case EventType.RUN_FORKED:
            if p.get("to_run"):
                return f"forked by {by} from step #{p.get('from_step')} to run {p['to_run']}"
            text = f"forked by {by} from run {p.get('from_run')} at step #{p.get('from_step')}"
            if isinstance(p.get("principal"), dict):
                text += f", acting as {p['principal'].get('to')} (was {p['principal'].get('from')})"
            if isinstance(p.get("model"), dict):
                text += f", on model {p['model'].get('to')} (was {p['model'].get('from')})"
            if p.get("carried_signals"):
                text += f", with signals {', '.join(map(str, p['carried_signals']))}"
            return text
        case EventType.RUN_SUCCEEDED | EventType.RUN_FAILED:
            reason = f": {p['reason']}" if p.get("reason") else ""
            return f"{event_type.split('.')[1]}{reason}"
        case EventType.RUN_SIGNALLED:
            return f"signal {p.get('name')!r} received from {actor}"
        case EventType.MCP_CALL_RECEIVED:
            key = f", client key {p['client_key']}" if p.get("client_key") else ""
            return f"MCP call #{p.get('position')} → {p.get('tool')} received from {actor}{key}"
        case EventType.QUESTION_ASKED:
            return f"question #{p.get('question_id')} asked of {p.get('group')}"
        case EventType.QUESTION_ANSWERED:
            return f"question #{p.get('question_id')} answered by {by}"
        case EventType.QUESTION_EMAIL_SENT | EventType.APPROVAL_EMAIL_SENT:
            subject = _emailed_about(event_type, p)
            again = " again" if p.get("resent") else ""
            return f"{subject} emailed{again} to {p.get('to')}"
        case EventType.QUESTION_EMAIL_FAILED | EventType.APPROVAL_EMAIL_FAILED:
            subject = _emailed_about(event_type, p)
            return f"{subject}: email to {p.get('to')} failed ({p.get('error')})"
        case EventType.QUESTION_LINK_USED | EventType.APPROVAL_LINK_USED:
            subject = _emailed_about(event_type, p)
            return f"{subject}: emailed link used by {p.get('by') or by}"
    return event_type


def _emailed_about(event_type: str, p: Mapping[str, Any]) -> str:
    if event_type.startswith("question."):
        return f"question #{p.get('question_id')}"
    return f"approval #{p.get('approval')}"


def _limits_change(p: Mapping[str, Any]) -> str:
    before, after = p.get("before") or {}, p.get("after") or {}
    changes = [
        f"{key} {before.get(key)} → {after.get(key)}"
        for key in ("max_steps", "max_cost", "max_tokens", "deadline")
        if before.get(key) != after.get(key)
    ]
    return ", ".join(changes) or "no change"


def _note(event_type: str, p: Mapping[str, Any]) -> str:
    """What an incarnation did that an operator reading its summary looks for."""
    match event_type:
        case EventType.TOOL_SUCCEEDED | EventType.TOOL_FAILED if (
            p.get("source") == "reconciliation"
        ):
            return f"reconciled {_call(p)} → {event_type.split('.')[1]}"
        case EventType.TOOL_RECONCILE_ATTEMPTED if p.get("outcome") != "found":
            return f"looked up {_call(p)}: {p.get('outcome')}"
        case EventType.TOOL_UNKNOWN:
            return f"{_call(p)} outcome unknown"
        case EventType.RUN_MIGRATED:
            return f"migrated v{p.get('from')} → v{p.get('to')}"
        case EventType.RUN_MODEL_CHANGED:
            return f"model {p.get('from')} → {p.get('to')}"
        case EventType.TOOL_DISPATCHING if (p.get("attempt") or 0) > 1:
            return f"dispatched {_call(p)} again (attempt {p.get('attempt')})"
    return ""


def _closing_text(event_type: str, p: Mapping[str, Any]) -> str:
    match event_type:
        case EventType.RUN_RELEASED:
            return f"released the lease ({p.get('status')})"
        case EventType.RUN_NEEDS_ATTENTION:
            return f"stopped for a person ({p.get('reason')})"
        case EventType.RUN_WAITING:
            return f"released the lease, waiting on {p.get('on')}"
        case EventType.RUN_PAUSED:
            return "paused"
    return f"finished the run ({event_type.removeprefix('run.')})"


def build(
    events: Iterable[Any],
    *,
    steps: Mapping[int, Any] | None = None,
    lease: LeaseNow | None = None,
    continued: bool = False,
    continues: bool = False,
    mask: Masker = UNMASKED,
) -> list[Group]:
    """Group ``events`` (ascending ``seq``) into incarnations.

    ``steps``: seq → Step, attached to ``step.decided`` entries. ``lease``: the run's lease
    now, for the last incarnation (None for an older page, whose last group ``continues``).
    ``continued``: events before the window exist. ``mask``: the viewer's masker for the
    run (runs.masking), applied to each payload before anything is described from it.
    """
    steps = steps or {}
    groups: list[Group] = []
    current: Group | None = None  # the incarnation whose worker may still write
    # what happened since the last claim in the window (None: no claim seen yet)
    since_claim: list[str] | None = [] if not continued else None
    for index, event in enumerate(events):
        # structure (step numbers, fences) from the record; what is shown, masked
        raw = event.payload or {}
        payload = mask(raw)
        worker = _worker_of(event.actor)
        if since_claim is not None and event.type != EventType.RUN_CLAIMED:
            since_claim.append(event.type)
        entry = Entry.of(
            event,
            payload,
            step=steps.get(raw.get("seq")) if event.type == EventType.STEP_DECIDED else None,
        )
        if event.type == EventType.RUN_CLAIMED:
            if current is not None and not current.closed:
                _mark_lost(current, by=worker)
            current = Group(
                kind="incarnation",
                incarnation=raw.get("fence", event.incarnation),
                worker=worker,
                recovered=bool(raw.get("recovered")),
                cause=_claim_cause(since_claim),
                started_at=event.created_at,
            )
            groups.append(current)
            since_claim = []
        elif worker and (current is None or current.incarnation != event.incarnation):
            # the window starts inside this incarnation
            if current is not None and not current.closed:
                _mark_lost(current, by=worker)
            current = Group(
                kind="incarnation",
                incarnation=event.incarnation,
                worker=worker,
                continued=continued and index == 0,
            )
            groups.append(current)
        elif not worker and (current is None or current.closed):
            # a person or the system acting while no worker holds the lease
            if not groups or groups[-1].kind != "outside":
                groups.append(Group(kind="outside", continued=continued and index == 0))
            groups[-1].entries.append(entry)
            if (
                event.type in (EventType.RUN_TERMINATED, EventType.RUN_FORKED)
                and current is not None
            ):
                current.closed = True
            continue
        assert current is not None
        current.entries.append(entry)
        if worker:
            note = _note(event.type, payload)
            if note and note not in current.notes:
                current.notes.append(note)
            if event.type in _RELEASING:
                current.closed = True
                current.end = "released"
                current.end_text = _closing_text(event.type, payload)
        elif event.type == EventType.RUN_TERMINATED and not current.closed:
            # an operator terminated the run while this incarnation's lease had expired:
            # this incarnation writes nothing more
            _mark_lost(current, by="")
    if current is not None and not current.closed:
        if continues:
            current.continues = True
        elif lease is not None and lease.live and lease.fence == current.incarnation:
            current.end = "holding"
            current.end_text = "holds the lease"
        elif lease is not None and lease.fence == current.incarnation and lease.owner:
            current.end = "expired"
            current.end_text = (
                f"its lease expired after {_boundary(current)}; another worker takes over"
            )
        else:
            _mark_lost(current, by="")
    return groups


# Why a worker claimed the run again, by what happened since the last claim (the first match
# wins): the fence still increments at every claim, but a claim after an approval is not a
# recovery, and the timeline should not read like one.
_CLAIM_CAUSES = (
    (EventType.RUN_RECOVERY_RETRIED, "after an operator's retry"),
    (EventType.RUN_RESUMED, "after an operator resumed it"),
    (EventType.APPROVAL_DECIDED, "after the approval was decided"),
    (EventType.APPROVAL_EXPIRED, "after the approval expired"),
    (EventType.RUN_SIGNALLED, "after a signal"),
    (EventType.QUESTION_ANSWERED, "after its question was answered"),
    (EventType.RUN_WAIT_TIMED_OUT, "after its wait timed out"),
    (EventType.RUN_BUDGET_TOPPED_UP, "after a budget top-up"),
    (EventType.TOOL_RESOLVED, "after a person resolved a call"),
    (EventType.RUN_HANDED_OFF, "handed over by a worker of another release"),
    (EventType.AGENT_POSTPONED, "after its decision was postponed"),
    (EventType.RUN_WAITING, "after its wait"),
    (EventType.RUN_RELEASED, "for its next slice"),
)


def _claim_cause(since_claim: list[str] | None) -> str:
    """ "" for the run's first claim (or when the window does not show what came before)."""
    if not since_claim:
        return ""
    for event_type, cause in _CLAIM_CAUSES:
        if event_type in since_claim:
            return cause
    return ""


def _boundary(group: Group) -> str:
    for entry in reversed(group.entries):
        if entry.actor.startswith("worker:"):
            return _BOUNDARY.get(entry.type, entry.type)
    return "claimed"


def _mark_lost(group: Group, *, by: str) -> None:
    group.closed = True
    group.end = "lost"
    group.lost_at = _boundary(group)
    group.taken_over_by = by
    after = f"; {by} took over" if by else ""
    group.end_text = f"lost its lease at {group.lost_at}{after}"


def step_seqs(events: Sequence[Any]) -> list[int]:
    """The step numbers the window's ``step.decided`` events name (to load those steps)."""
    return [
        e.payload["seq"]
        for e in events
        if e.type == EventType.STEP_DECIDED and isinstance((e.payload or {}).get("seq"), int)
    ]


def reconciliation_history(
    events: Iterable[Any], *, masks: Mapping[Any, Masker]
) -> dict[tuple[Any, int], list[Entry]]:
    """(run id, step seq) → the lookups, unknown marks, dispatches and resolutions of that
    call, oldest first: what the unknown-outcomes inbox shows under each call. ``masks``:
    run id → the viewer's masker (runs.masking)."""
    history: dict[tuple[Any, int], list[Entry]] = {}
    for event in events:
        seq = (event.payload or {}).get("seq")
        if not isinstance(seq, int):
            continue
        payload = masks[event.run_id](event.payload)
        history.setdefault((event.run_id, seq), []).append(Entry.of(event, payload))
    return history

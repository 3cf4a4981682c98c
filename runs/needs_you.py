""" "Needs you": one entry per thing a person must do now, for the signed-in user (issue 21).

What counts: runs parked in ``needs_attention``; tool calls whose unknown outcome the engine
has given up on (their run is in ``needs_attention``: while it still reconciles by itself,
nobody has anything to do); open questions for the user's groups; and whatever other apps
register (the approvals app: pending approvals the user may decide). A run stopped at
``unknown_outcome`` is one thing, listed once as its call (which is what a person resolves),
not once as a run and once as a call. The count is the length of the list.

``runs`` never imports ``approvals``: that app registers its source in ``ready()``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from django.db.models.functions import Now
from django.urls import reverse

from runs.masking import maskers_for
from runs.models import Question, Run, ToolCall

SHOWN = 100  # per source: an incident with more than this is worked from the inboxes


@dataclass(frozen=True)
class NeedsYouItem:
    kind: str  # "approval", "unknown_outcome", "needs_attention", "question"
    # one per thing: the same thing reported twice is listed once ("approval:3")
    key: str
    title: str
    url: str
    run_id: Any
    run_agent: str
    run_goal: str
    # when it expires (an approval, a question), else None; the list is soonest first
    due_at: datetime | None = None
    # since when it has waited (shown when there is no due time)
    since: datetime | None = None
    detail: str = ""
    reason_code: str = ""
    # why the run stopped for a person, as this viewer may see it (runs.masking)
    reason: str = ""
    # the run is a dry run (its badge is shown beside it)
    run_dry_run: bool = False


NeedsYouSource = Callable[[Any, int], list[NeedsYouItem]]
_sources: list[NeedsYouSource] = []


def register_needs_you_source(source: NeedsYouSource) -> None:
    """``source(user, limit)`` returns what ``user`` must do, in a bounded number of
    queries, only things the user may act on."""
    if source not in _sources:
        _sources.append(source)


@dataclass(frozen=True)
class NeedsYou:
    items: list[NeedsYouItem]

    @property
    def count(self) -> int:
        return len(self.items)

    def of_kind(self, kind: str) -> list[NeedsYouItem]:
        return [item for item in self.items if item.kind == kind]


def needs_you(*, user: Any, limit: int = SHOWN) -> NeedsYou:
    """Everything ``user`` must do now: due soonest first, then the longest waiting."""
    if user is None or not user.is_authenticated:
        return NeedsYou(items=[])
    seen: dict[str, NeedsYouItem] = {}
    for source in [*_builtin_sources(), *_sources]:
        for item in source(user, limit):
            seen.setdefault(item.key, item)
    far = datetime.max.replace(tzinfo=UTC)
    items = sorted(
        seen.values(), key=lambda item: (item.due_at or far, item.since or far, item.key)
    )
    return NeedsYou(items=items)


def _builtin_sources() -> list[NeedsYouSource]:
    return [_unknown_and_parked, _questions]


def _unknown_and_parked(user: Any, limit: int) -> list[NeedsYouItem]:
    """Runs in ``needs_attention`` (operators) and the unknown outcomes that stopped them
    (who may resolve calls): two queries, and one for masking their reasons."""
    calls: list[ToolCall] = []
    if user.has_perm("runs.resolve_toolcall"):
        calls = list(
            ToolCall.objects.filter(
                status=ToolCall.Status.UNKNOWN, run__status=Run.Status.NEEDS_ATTENTION
            )
            .select_related("run", "step")
            .only(
                "id",
                "tool_name",
                "effect",
                "updated_at",
                "reconcile_attempts",
                "run__id",
                "run__agent_name",
                "run__goal",
                "run__reason_detail",
                "run__dry_run",
                "step__seq",
            )
            .order_by("updated_at", "id")[:limit]
        )
    # a run stopped at its unknown call is listed as that call: one thing, one entry
    covered = {call.run_id for call in calls}
    runs: list[Run] = []
    if user.has_perm("runs.operate_run"):
        runs = [
            run
            for run in Run.objects.filter(status=Run.Status.NEEDS_ATTENTION)
            .only(
                "id", "agent_name", "goal", "reason_code", "reason_detail", "updated_at", "dry_run"
            )
            .order_by("updated_at", "id")[:limit]
            if run.id not in covered
        ]
    # a reason may quote a value the agent read (runs.masking): shown masked
    masks = maskers_for([*{call.run_id: call.run for call in calls}.values(), *runs], user=user)
    items = [
        NeedsYouItem(
            kind="unknown_outcome",
            key=f"toolcall:{call.id}",
            title=f"Resolve the unknown outcome of {call.tool_name} (call #{call.step.seq})",
            url=reverse("runs:unknown") + f"#call-{call.id}",
            run_id=call.run_id,
            run_agent=call.run.agent_name,
            run_dry_run=call.run.dry_run,
            run_goal=call.run.goal,
            since=call.updated_at,
            detail=f"{call.effect} · {call.reconcile_attempts} lookup"
            + ("" if call.reconcile_attempts == 1 else "s"),
            reason=str(masks[call.run_id](call.run.reason_detail) or ""),
        )
        for call in calls
    ]
    items.extend(
        NeedsYouItem(
            kind="needs_attention",
            key=f"run:{run.id}",
            title="Decide what this run does next",
            url=reverse("runs:detail", args=[run.id]),
            run_id=run.id,
            run_agent=run.agent_name,
            run_dry_run=run.dry_run,
            run_goal=run.goal,
            since=run.updated_at,
            reason_code=run.reason_code,
            reason=str(masks[run.id](run.reason_detail) or ""),
        )
        for run in runs
    )
    return items


def _questions(user: Any, limit: int) -> list[NeedsYouItem]:
    """Open, unexpired questions for the user's groups: one query."""
    questions = Question.objects.filter(
        status=Question.Status.OPEN, expires_at__gt=Now()
    ).select_related("run")
    if not user.is_superuser:
        questions = questions.filter(group__in=user.groups.values("name"))
    questions = questions.only(
        "id", "group", "expires_at", "run__id", "run__agent_name", "run__goal", "run__dry_run"
    ).order_by("expires_at", "id")[:limit]
    return [
        NeedsYouItem(
            kind="question",
            key=f"question:{question.id}",
            title=f"Answer a question for {question.group}",
            url=reverse("runs:question", args=[question.id]),
            run_id=question.run_id,
            run_agent=question.run.agent_name,
            run_dry_run=question.run.dry_run,
            run_goal=question.run.goal,
            due_at=question.expires_at,
        )
        for question in questions
    ]

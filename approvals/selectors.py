"""Reads for the approvals pages, with no per-row queries."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from django.db.models import Prefetch, Q, QuerySet
from django.utils import timezone

from approvals.models import Approval, ApprovalDecision, ApprovalLink
from runs.models import ApiToken, RunEvent, Step, ToolCall
from runs.record.eventtypes import EventType


def _group_names(user: Any) -> frozenset[str]:
    """The user's group names, read once per user object (a request's pages ask several
    times: which approvals they see, which they may decide)."""
    names = getattr(user, "_approvals_group_names", None)
    if names is None:
        names = frozenset(user.groups.values_list("name", flat=True))
        user._approvals_group_names = names
    return names


def _visible_to(user: Any) -> QuerySet[Approval]:
    """Approvals of the groups the user belongs to — the approval's group, or a group with a
    minimum in it (approvals.quorum) — all of them for a superuser."""
    approvals = Approval.objects.select_related("run")
    if not user.is_superuser:
        names = sorted(_group_names(user))
        mine = Q(approver_group__in=names)
        if names:
            mine |= Q(group_minimums__has_any_keys=names)
        approvals = approvals.filter(mine)
    return approvals


@dataclass
class Inbox:
    pending: list[Approval]
    recent: list[Approval]
    agents: list[str]
    tools: list[str]


def approval_inbox(*, user: Any, agent: str = "", tool: str = "", recent_limit: int = 25) -> Inbox:
    """The signed-in approver's approvals: pending ones first (soonest to expire first),
    then the latest settled ones; optionally only one agent's or one tool's."""
    visible = _visible_to(user)
    filtered = visible
    if agent:
        filtered = filtered.filter(run__agent_name=agent)
    if tool:
        filtered = filtered.filter(tool_name=tool)
    pending = list(filtered.filter(status=Approval.Status.PENDING).order_by("expires_at")[:200])
    recent = list(
        filtered.exclude(status=Approval.Status.PENDING).order_by("-requested_at")[:recent_limit]
    )
    agents = sorted(set(visible.order_by().values_list("run__agent_name", flat=True)))
    tools = sorted(set(visible.order_by().values_list("tool_name", flat=True)))
    return Inbox(pending=pending, recent=recent, agents=agents, tools=tools)


@dataclass
class ApprovalContext:
    approval: Approval
    call: ToolCall
    decisions: list[ApprovalDecision]
    steps: list[Step]
    events: list[RunEvent]


def approval_context(*, approval_id: Any, event_limit: int = 30) -> ApprovalContext:
    """One approval with its run, call, decisions, the run's steps and latest events
    (Approval.DoesNotExist if there is none)."""
    decisions = ApprovalDecision.objects.select_related("decider")
    approval = (
        Approval.objects.select_related("run", "run__principal")
        .prefetch_related(Prefetch("decisions", queryset=decisions))
        .get(id=approval_id)
    )
    call = ToolCall.objects.select_related("step").get(id=approval.tool_call_id)
    steps = list(
        Step.objects.filter(run_id=approval.run_id)
        .only("seq", "kind", "status", "input", "error", "created_at")
        .order_by("seq")
    )
    events = list(
        RunEvent.objects.filter(run_id=approval.run_id)
        .only("seq", "type", "actor", "channel", "created_at")
        .order_by("-seq")[:event_limit]
    )
    return ApprovalContext(
        approval=approval,
        call=call,
        decisions=list(approval.decisions.all()),
        steps=steps,
        events=events,
    )


PAST_TENSE = {"approve": "approved", "reject": "rejected"}


def user_may_decide(*, user: Any, approval: Approval) -> bool:
    """Whether to offer the decision form (the service decides for real)."""
    return not why_not_decide(user=user, approval=approval)


def why_not_decide(*, user: Any, approval: Approval) -> str:
    """The one rule that keeps ``user`` from deciding ``approval``, in words ("" when they
    may): the page says which applies instead of listing every possibility."""
    if not user.has_perm("approvals.decide_approval"):
        return "You do not have the approver role (permission approvals.decide_approval)."
    if approval.status != Approval.Status.PENDING:
        return f"This approval is already {approval.status}."
    if approval.expires_at <= timezone.now():
        return "It has expired (the sweeper records that within seconds)."
    eligible = approval.eligible_groups
    if not user.is_superuser and not user.groups.filter(name__in=eligible).exists():
        if len(eligible) == 1:
            return f"It is addressed to group {approval.approver_group}, and you are not in it."
        return f"It is addressed to groups {' and '.join(eligible)}, and you are in none of them."
    decided = (
        approval.decisions.filter(decider=user, decision__in=ApprovalDecision.DECIDING)
        .values_list("decision", flat=True)
        .first()
    )
    if decided is not None:
        return (
            f"You already {PAST_TENSE.get(decided, decided)} it; someone else in "
            f"{' or '.join(eligible)} must decide too."
        )
    seat = quorum_refusal(user=user, approval=approval)
    if seat:
        return f"{seat[0].upper()}{seat[1:]}."
    conflict = duty_conflict(user=user, approval=approval, principal_id=approval.run.principal_id)
    if conflict:
        who = "someone else"
        if conflict.startswith("the run's principal"):
            who = f"another member of {approval.approver_group}"
            conflict = (
                f"You are the run's principal ({user.get_username()}): the run acts as you, "
                "and nobody approves their own action"
            )
        return f"{conflict[0].upper()}{conflict[1:]}; {who} must decide it."
    return ""


def link_decision(*, link: ApprovalLink) -> ApprovalDecision | None:
    """The decision the link's approver made on its approval, if any."""
    return (
        ApprovalDecision.objects.select_related("decider")
        .filter(
            approval_id=link.approval_id,
            decider_id=link.approver_id,
            decision__in=ApprovalDecision.DECIDING,
        )
        .first()
    )


def decidable(*, user: Any, approvals: list[Approval]) -> list[Approval]:
    """Those of ``approvals`` that ``user`` may decide now — the rules of
    ``why_not_decide`` for a whole list in at most four queries, whatever its length (the
    inbox's buttons, "Needs you"). The service still decides for real."""
    if not approvals or not user.has_perm("approvals.decide_approval"):
        return []
    groups = None if user.is_superuser else set(_group_names(user))
    now = timezone.now()
    candidates = [
        a
        for a in approvals
        if a.status == Approval.Status.PENDING
        and a.expires_at > now
        and (groups is None or groups & set(a.eligible_groups))
        and (a.allow_self_approval or a.run.principal_id != user.pk)
    ]
    decided = set(
        ApprovalDecision.objects.filter(
            approval_id__in=[a.id for a in candidates],
            decider=user,
            decision__in=ApprovalDecision.DECIDING,
        ).values_list("approval_id", flat=True)
    )
    candidates = [a for a in candidates if a.id not in decided]
    candidates = _quorum_open(user=user, approvals=candidates)
    separated = {a.run_id for a in candidates if a.separate_duties}
    drove: set[Any] = set()
    if separated:
        label = f"user:{user.get_username()}"
        tokens = ApiToken.objects.filter(Q(principal=user) | Q(created_by=label)).values_list(
            "name", flat=True
        )
        drove = set(
            RunEvent.objects.filter(
                run_id__in=separated,
                type__in=DRIVING_EVENTS,
                actor__in=[label, *(f"token:{name}" for name in tokens)],
            ).values_list("run_id", flat=True)
        )
    return [a for a in candidates if not (a.separate_duties and a.run_id in drove)]


def approvals_needing_me(user: Any, limit: int) -> list[Any]:
    """Pending, unexpired approvals ``user`` may decide, soonest to expire first, for the
    console's "Needs you" (``runs.needs_you``; registered in ``ApprovalsConfig.ready`` so
    that ``runs`` never imports ``approvals``): a person is never told to decide what the
    service would refuse."""
    from django.db.models.functions import Now
    from django.urls import reverse

    from runs.masking import maskers_for
    from runs.needs_you import NeedsYouItem
    from runs.registry import call_summary

    if not user.has_perm("approvals.decide_approval"):
        return []
    approvals = list(
        _visible_to(user)
        .filter(status=Approval.Status.PENDING, expires_at__gt=Now())
        .exclude(Q(run__principal=user) & Q(allow_self_approval=False))
        .order_by("expires_at", "id")[:limit]
    )
    approvals = decidable(user=user, approvals=approvals)
    masks = maskers_for({a.run_id: a.run for a in approvals}.values(), user=user)
    return [
        NeedsYouItem(
            kind="approval",
            key=f"approval:{approval.id}",
            title=call_summary(
                approval.tool_name, masks[approval.run_id](approval.arguments_masked)
            ),
            url=reverse("approvals:detail", args=[approval.id]),
            run_id=approval.run_id,
            run_agent=approval.run.agent_name,
            run_dry_run=approval.run.dry_run,
            run_goal=approval.run.goal,
            due_at=approval.expires_at,
            detail=f"approval for {approval.approver_group}",
        )
        for approval in approvals
    ]


def _quorum_open(*, user: Any, approvals: list[Approval]) -> list[Approval]:
    """``approvals`` less those whose remaining approvals are reserved for a group's
    minimum ``user`` is not in (two queries when any has a minimum, none otherwise)."""
    quota = [a for a in approvals if a.group_minimums]
    if not quota:
        return approvals
    from approvals import quorum

    by_approval: dict[Any, list[quorum.Approver]] = {}
    rows = (
        ApprovalDecision.objects.filter(
            approval_id__in=[a.id for a in quota], decision=ApprovalDecision.Decision.APPROVE
        )
        .select_related("decider")
        .prefetch_related("decider__groups")
    )
    for row in rows:
        by_approval.setdefault(row.approval_id, []).append(
            quorum.Approver(
                key=row.decider_id,
                groups=frozenset(g.name for g in row.decider.groups.all()),
                superuser=row.decider.is_superuser,
            )
        )
    me = quorum.Approver(key=user.pk, groups=_group_names(user), superuser=user.is_superuser)
    refused = {
        a.id
        for a in quota
        if quorum.refusal(
            by_approval.get(a.id, []),
            me,
            group=a.approver_group,
            required=a.required_count,
            minimums=a.group_minimums,
        )
    }
    return [a for a in approvals if a.id not in refused]


def quorum_refusal(*, user: Any, approval: Approval) -> str:
    """Why ``user``'s approval would not count towards ``approval``'s quorum ("" when it
    would): the approvals still needed are reserved for a group's minimum they are not in."""
    if not approval.group_minimums:
        return ""
    from approvals import quorum
    from approvals.gate import approvers_of

    me = quorum.Approver(
        key=user.pk,
        groups=frozenset(user.groups.values_list("name", flat=True)),
        superuser=user.is_superuser,
    )
    return quorum.refusal(
        approvers_of(approval),
        me,
        group=approval.approver_group,
        required=approval.required_count,
        minimums=approval.group_minimums,
    )


@dataclass
class Requested:
    """An earlier request for the same call, cancelled and asked again: why, and whose
    decisions on it no longer count (they do not carry over)."""

    approval: Approval
    voided: list[ApprovalDecision]


def earlier_requests(approval: Approval) -> list[Requested]:
    """The call's earlier approvals that were cancelled before this one was asked (newest
    first), each with the decisions it had: the approval page says which were voided."""
    earlier = list(
        Approval.objects.filter(
            tool_call_id=approval.tool_call_id,
            id__lt=approval.id,
            status=Approval.Status.CANCELLED,
        )
        .prefetch_related(
            Prefetch(
                "decisions",
                queryset=ApprovalDecision.objects.filter(
                    decision__in=ApprovalDecision.DECIDING
                ).select_related("decider"),
            )
        )
        .order_by("-id")
    )
    return [Requested(approval=a, voided=list(a.decisions.all())) for a in earlier]


# Who drove a run, from its record: these events name the person who started, forked,
# signalled or resolved it (DESIGN §9: nobody who drove a run approves its calls)
DRIVING_EVENTS = (
    EventType.RUN_CREATED,
    EventType.RUN_FORKED,
    EventType.RUN_SIGNALLED,
    EventType.TOOL_RESOLVED,
)


def duty_conflict(*, user: Any, approval: Approval, principal_id: Any) -> str:
    """Why ``user`` may not decide ``approval`` under separation of duties; "" when they
    may. One rule for every channel: approval_decide enforces it, pages and emails follow
    it."""
    if not approval.allow_self_approval and principal_id is not None and principal_id == user.pk:
        return "the run's principal may not approve its own action"
    if not approval.separate_duties:
        return ""
    label = f"user:{user.get_username()}"
    # as themselves, or through an API token that acts as them or that they created (a
    # service account's token a person started the run with)
    tokens = ApiToken.objects.filter(Q(principal=user) | Q(created_by=label)).values_list(
        "name", flat=True
    )
    drove = (
        RunEvent.objects.filter(
            run_id=approval.run_id,
            type__in=DRIVING_EVENTS,
            actor__in=[label, *(f"token:{name}" for name in tokens)],
        )
        .values_list("type", flat=True)
        .first()
    )
    if drove is not None:
        return (
            f"{user.get_username()} drove this run ({drove}): separation of duties needs "
            "someone else to approve its calls"
        )
    return ""

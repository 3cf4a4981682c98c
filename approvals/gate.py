"""The approvals app's implementation of ``runs.gate.ApprovalGate``."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from django.db import transaction
from django.db.models import Q
from django.db.models.functions import Now
from django.db.models.signals import post_save
from django.dispatch import receiver

from approvals import policies, quorum
from approvals.models import Approval, ApprovalDecision, ApprovalPolicyVersion
from approvals.notify import links_create_and_email
from runs.dbtime import db_now
from runs.gate import GateRefused, GateView, Verdict, code_verdict, recorded_facts
from runs.record import configcache
from runs.record.eventtypes import EventType


def current_version(
    tool_name: str, *, agent: str = "", groups: Any = ()
) -> ApprovalPolicyVersion | None:
    """The published version of the most specific data policy for this tool, agent and
    principal's groups (agent and group > agent > group > the tool's own), or None: the
    tool's code policy applies. A withdrawn policy (its current version a withdrawal) is
    out of force: the next broader one applies. One query."""
    candidates = list(
        ApprovalPolicyVersion.objects.filter(
            status=ApprovalPolicyVersion.Status.PUBLISHED,
            policy__tool_name=tool_name,
            withdraws=False,
        )
        .filter(Q(policy__agent_name="") | Q(policy__agent_name=agent or ""))
        .filter(Q(policy__principal_group="") | Q(policy__principal_group__in=list(groups or ())))
        .select_related("policy")
    )
    return most_specific(candidates, agent=agent, groups=groups)


def most_specific(
    candidates: list[ApprovalPolicyVersion], *, agent: str = "", groups: Any = ()
) -> ApprovalPolicyVersion | None:
    """Of published versions (of one tool's policies), the one that governs a call of
    ``agent`` by a principal in ``groups`` (None: the code policy). Withdrawals are skipped."""
    groups = set(groups or ())
    candidates = [
        v
        for v in candidates
        if not v.withdraws
        and v.policy.agent_name in ("", agent or "")
        and (not v.policy.principal_group or v.policy.principal_group in groups)
    ]
    if not candidates:
        return None
    return max(
        candidates,
        key=lambda v: (
            bool(v.policy.agent_name) * 2 + bool(v.policy.principal_group),
            # two group policies for a principal in both: the first group by name, so
            # every process picks the same one
            [-ord(c) for c in v.policy.principal_group],
        ),
    )


def _read_published_tools(generation: str | None) -> frozenset[str]:
    return frozenset(
        ApprovalPolicyVersion.objects.filter(
            status=ApprovalPolicyVersion.Status.PUBLISHED, withdraws=False
        ).values_list("policy__tool_name", flat=True)
    )


# Which tools have a published data policy, as this process read it since it last changed
# anywhere (one query for all of them; triggers move the generation: migration 0015). A call
# of a tool that has none is decided by its code policy with no query — the hot path of every
# step (docs/benchmarks.md: one statement per read step).
published_tools = configcache.register(
    "policies",
    generation_sql=configcache.token_generation_sql("policies"),
    read=_read_published_tools,
)


@receiver(post_save, sender=ApprovalPolicyVersion)
def _policy_version_saved(sender: Any, **kwargs: Any) -> None:
    # published, superseded or withdrawn here: this process reads them again after the commit,
    # before any claim tells it (a decision it takes right after a publish applies it)
    transaction.on_commit(published_tools.forget)


def verdict_of(
    version: ApprovalPolicyVersion, *, tool_name: str, arguments: Any, facts: dict[str, Any]
) -> Verdict:
    outcome = policies.evaluate(
        version.rules,
        arguments=arguments,
        facts=facts,
        tool=tool_name,
        time_zone=version.time_zone,
    )
    reason = outcome.reason
    if outcome.decision == Verdict.DENY and not reason:
        reason = f"rule {outcome.rule} of policy version {version.number}"
    return Verdict(
        outcome.decision, reason=reason, policy_version=version.id, requirement=outcome.requirement
    )


def approvers_of(approval: Approval) -> list[quorum.Approver]:
    """Who approved ``approval``, with their groups as of now (two queries)."""
    from django.contrib.auth import get_user_model

    ids = list(
        ApprovalDecision.objects.filter(
            approval=approval, decision=ApprovalDecision.Decision.APPROVE
        ).values_list("decider_id", flat=True)
    )
    users = get_user_model().objects.filter(pk__in=ids).prefetch_related("groups")
    return [
        quorum.Approver(
            key=user.pk,
            groups=frozenset(g.name for g in user.groups.all()),
            superuser=user.is_superuser,
        )
        for user in users
    ]


def quorum_of(approval: Approval) -> quorum.Quorum:
    """Where ``approval`` stands against its own quorum ("1 of 2, needs 1 from finance")."""
    return quorum.assess(
        approvers_of(approval),
        group=approval.approver_group,
        required=approval.required_count,
        minimums=approval.group_minimums,
    )


def satisfies(approval: Approval, requirement: policies.Requirement) -> bool:
    """Whether what was approved meets ``requirement`` (the current policy's): enough
    approvers from the groups it names, with each group's minimum filled. A stricter policy
    is not met by fewer approvers, or by approvers from another group; a looser one is."""
    return quorum.assess(
        approvers_of(approval),
        group=requirement.group,
        required=requirement.required,
        minimums=requirement.minimums,
    ).met


def pending_satisfies(approval: Approval, requirement: policies.Requirement) -> bool:
    """Whether a pending approval asks at least what ``requirement`` asks: the same group,
    no fewer approvers, no smaller minimum of any group, and no group allowed to decide
    that ``requirement`` does not allow (it settles only once all that is met)."""
    asked = approval.group_minimums or {}
    wanted = requirement.minimums
    return (
        approval.approver_group == requirement.group
        and approval.required_count >= requirement.required
        and all(asked.get(g, 0) >= n for g, n in wanted.items())
        and set(approval.eligible_groups) <= {requirement.group, *wanted}
    )


def code_requirement(tool) -> policies.Requirement:
    """The tool's code policy as a requirement (what it asks when it asks)."""
    code = tool.approval
    return policies.Requirement(
        group=code.group,
        required=code.required,
        ttl_seconds=code.ttl_seconds,
        on_expiry=str(code.on_expiry),
        escalate_to=code.escalate_to,
        bearer_links=code.bearer_links,
    )


def voided_decisions(approval: Approval) -> list[dict[str, Any]]:
    """The approvals people gave ``approval`` (cancelled now): named in the events that
    cancel it and ask again, so nobody wonders where their approval went. They do not carry
    over (docs/approvals.md, "When a policy changes")."""
    return [
        {"by": username, "decision": decision, "at": created_at.isoformat()}
        for username, decision, created_at in ApprovalDecision.objects.filter(
            approval=approval, decision__in=ApprovalDecision.DECIDING
        )
        .order_by("created_at")
        .values_list("decider__username", "decision", "created_at")
    ]


def approval_create(
    *, cp, call, requirement: policies.Requirement | None, tool=None, version_id=None, **event
) -> Approval:
    """A pending approval for ``call``: what a data policy's rule requires, or the tool's
    code policy (``requirement`` None), copied onto the approval; ``approval.requested``
    appended and each eligible approver emailed after the commit."""
    if requirement is None:
        code = tool.approval
        requirement = code_requirement(tool)
        allow_self, separate = code.allow_self_approval, code.separate_duties
    else:
        allow_self, separate = False, True
    approval = Approval.objects.create(
        run_id=call.run_id,
        tool_call=call,
        tool_name=call.tool_name,
        tool_version=call.tool_version,
        arguments_digest=call.arguments_digest,
        precondition_fingerprint=call.precondition_fingerprint,
        arguments_masked=call.arguments_masked,
        approver_group=requirement.group,
        required_count=requirement.required,
        group_minimums=requirement.minimums,
        allow_self_approval=allow_self,
        require_login=not requirement.bearer_links,
        separate_duties=separate,
        on_expiry=requirement.on_expiry,
        escalate_to=requirement.escalate_to,
        ttl_seconds=requirement.ttl_seconds,
        policy_version_id=version_id,
        # database time, like every expiry check
        expires_at=db_now() + timedelta(seconds=requirement.ttl_seconds),
    )
    cp.event(
        EventType.APPROVAL_REQUESTED,
        approval=approval.id,
        seq=call.step.seq,
        tool=call.tool_name,
        arguments=call.arguments_masked,
        group=requirement.group,
        required=requirement.required,
        from_groups=requirement.minimums,
        expires_at=approval.expires_at.isoformat(),
        policy_version=version_id,
        **event,
    )
    # each eligible approver gets an email with their own link, sent after the commit
    links_create_and_email(approval=approval, principal_id=cp.run.principal_id)
    return approval


class ApprovalsGate:
    def assess(self, *, run, tool, arguments, facts) -> Verdict:
        if tool.name not in published_tools.get():
            return code_verdict(tool, arguments)
        version = current_version(
            tool.name, agent=facts.get("agent", ""), groups=facts.get("groups", ())
        )
        if version is None:
            return code_verdict(tool, arguments)
        return verdict_of(version, tool_name=tool.name, arguments=arguments, facts=facts)

    def approvals_of(self, call_ids) -> dict:
        views: dict = {}
        rows = (
            Approval.objects.filter(tool_call_id__in=list(call_ids))
            .order_by("id")
            .values_list("tool_call_id", "id", "status", "consumed_at")
        )
        for call_id, approval_id, status, consumed_at in rows:
            state = "consumed" if consumed_at is not None else status
            views.setdefault(call_id, []).append(GateView(approval_id, state))
        return views

    def request(self, *, cp, run, call, tool) -> None:
        verdict = self.assess(
            run=run, tool=tool, arguments=call.arguments, facts=recorded_facts(run, call)
        )
        # asked again (the dispatch found the last one superseded or short of the current
        # policy: ``cancel`` ran just before, in this transaction): say which approval this
        # replaces and whose decisions on it no longer count
        previous = (
            Approval.objects.filter(tool_call=call, status=Approval.Status.CANCELLED)
            .order_by("-id")
            .first()
            # a call decided in this commit is not written yet (the checkpoint writes it
            # with the commit's statement): it has no earlier approval
            if call.pk is not None
            else None
        )
        again: dict[str, Any] = {}
        if (
            previous is not None
            and not Approval.objects.filter(tool_call=call, id__gt=previous.id).exists()
        ):
            again = {
                "replaces": previous.id,
                "why": previous.reason,
                "voided": voided_decisions(previous),
            }
        # a data policy's requirement when one asks; otherwise (no data policy, or a
        # re-request its current version would allow) the tool's code policy
        approval_create(
            cp=cp,
            call=call,
            tool=tool,
            requirement=verdict.requirement if verdict.needs_approval else None,
            version_id=verdict.policy_version if verdict.needs_approval else None,
            **again,
        )

    def consume(self, *, cp, call, tool, verdict=None) -> None:
        # the data policy in force now, read afresh in this transaction rather than from
        # what this process last read (``published_tools``): an approval is always checked
        # against the version current at its use
        facts = recorded_facts(cp.run, call)
        version = current_version(
            tool.name, agent=facts.get("agent", ""), groups=facts.get("groups", ())
        )
        if version is not None:
            verdict = verdict_of(
                version, tool_name=tool.name, arguments=call.arguments, facts=facts
            )
            if verdict.denied:
                raise GateRefused(
                    f"the current policy (version {version.number}) denies this call",
                    reason="policy_changed",
                )
        elif verdict is not None and verdict.policy_version is not None:
            verdict = code_verdict(tool, call.arguments)  # the data policy was withdrawn
        if verdict is not None and verdict.needs_approval:
            # the current policy, re-evaluated in this transaction: an approval given under
            # a looser one (fewer approvers, another group, a group's minimum unmet) is
            # withdrawn and asked again — never used for a call the current rules would not
            # let through. The code policy is checked too for an approval a data policy
            # asked for (the data policy was withdrawn since); approvals the code policy
            # asked for keep their own rules.
            approval = Approval.objects.filter(
                tool_call=call, status=Approval.Status.APPROVED, consumed_at__isnull=True
            ).first()
            requirement = verdict.requirement
            if (
                requirement is None
                and approval is not None
                and approval.policy_version_id is not None
            ):
                requirement = code_requirement(tool)
            if (
                requirement is not None
                and approval is not None
                and not satisfies(approval, requirement)
            ):
                raise GateRefused(
                    f"the approval no longer satisfies the current policy: it needs "
                    f"{requirement.describe()}",
                    reason="policy_changed",
                )
        # One conditional UPDATE: an approval is consumed exactly once, and only while it is
        # still bound to this exact call (tool, version, arguments) and not expired.
        consumed = Approval.objects.filter(
            tool_call=call,
            # and of this call's own run: an approval (a dry run's too) is never another's
            run_id=call.run_id,
            status=Approval.Status.APPROVED,
            consumed_at__isnull=True,
            tool_name=call.tool_name,
            tool_version=call.tool_version,
            arguments_digest=call.arguments_digest,
            precondition_fingerprint=call.precondition_fingerprint,
        ).update(consumed_at=Now())
        if consumed != 1:
            raise GateRefused("no unconsumed approval bound to this call")
        cp.event(EventType.APPROVAL_CONSUMED, seq=call.step.seq, tool=call.tool_name)

    def cancel(self, *, cp, call, reason) -> None:
        live = Approval.objects.filter(
            tool_call=call,
            status__in=[Approval.Status.PENDING, Approval.Status.APPROVED],
            consumed_at__isnull=True,
        )
        for approval in live:
            approval.status = Approval.Status.CANCELLED
            approval.reason = reason
            approval.save(update_fields=["status", "reason"])
            voided = voided_decisions(approval)
            extra = {"voided": voided} if voided else {}
            cp.event(EventType.APPROVAL_CANCELLED, approval=approval.id, reason=reason, **extra)

"""Approval policies as versioned data: draft, simulate, publish (docs/approvals.md,
"Policies"). The console, the API and ``policy_simulate`` call these. Every change is a new
version (who, when, why) and an audit entry naming the actor; publishing needs a second
person, and re-checks every pending approval of the tool against the new version.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from django.contrib.auth.models import Group
from django.db import transaction
from django.utils import timezone

from approvals import policies
from approvals.gate import (
    approval_create,
    code_requirement,
    current_version,
    most_specific,
    pending_satisfies,
    verdict_of,
    voided_decisions,
)
from approvals.models import Approval, ApprovalPolicy, ApprovalPolicyVersion
from runs.actors import Actor, PermissionDenied
from runs.audit.entries import audit_record
from runs.errors import NotFound
from runs.gate import Verdict, code_verdict, policy_facts
from runs.models import ToolCall
from runs.record import configcache
from runs.record.checkpoint import checkpoint
from runs.record.eventtypes import EventType
from runs.registry import UnknownTool, call_summary, registry
from runs.services import InvalidInput, InvalidState, toolcall_gate_settled

MANAGE = "approvals.manage_approvalpolicy"
NOTE_MAX = 2000
SIMULATE_MAX_DAYS = 90
SIMULATE_MAX_CALLS = 5000


class PolicyInvalid(InvalidInput):
    """The version's rules do not validate; nothing was written. ``fields``: messages by
    field (``rule 2``, ``time_zone``, ``note``): the API's ``validation_error`` fields."""

    fields: dict[str, list[str]]  # always given (DomainError's may be None)

    def __init__(self, fields: dict[str, list[str]]) -> None:
        summary = "; ".join(f"{where}: {' '.join(msgs)}" for where, msgs in fields.items())
        super().__init__(f"the policy is not valid: {summary}")
        self.fields = fields


class PolicyConflict(InvalidState):
    """Not a draft any more, or drafted against a version that is no longer current
    (``invalid_state``: 409)."""


class SeparationOfDuties(PermissionDenied):
    """The drafter tried to publish (``permission_denied``: 403)."""


def _tool_schema(tool_name: str) -> dict[str, Any] | None:
    try:
        return dict(registry.tool(tool_name).schema)
    except UnknownTool:
        return None


def version_validate(*, tool_name: str, rules: Any, time_zone: str, note: str) -> None:
    errors = policies.validate(
        rules,
        time_zone=time_zone,
        tool_schema=_tool_schema(tool_name),
        groups=set(Group.objects.values_list("name", flat=True)),
    )
    if not (note or "").strip():
        errors.setdefault("note", []).append("say why: every version records the reason for it")
    elif len(note) > NOTE_MAX:
        errors.setdefault("note", []).append(f"at most {NOTE_MAX} characters")
    if errors:
        raise PolicyInvalid(errors)


def _snapshot(version: ApprovalPolicyVersion) -> dict[str, Any]:
    return {
        "policy": version.policy_id,
        "tool": version.policy.tool_name,
        "number": version.number,
        "status": version.status,
        "rules": version.rules,
        "time_zone": version.time_zone,
        "note": version.note,
        "withdraws": version.withdraws,
    }


def policy_version_draft(
    *,
    actor: Actor,
    tool_name: str,
    rules: Any,
    note: str,
    time_zone: str = "UTC",
    agent_name: str = "",
    principal_group: str = "",
    based_on: int | None = None,
) -> ApprovalPolicyVersion:
    """Write a new draft version (the policy itself is created with its first one).
    Validated first: ``PolicyInvalid`` and nothing written. ``based_on``: the published
    version the draft was written against (default: the current one)."""
    actor.require(MANAGE)
    if not tool_name:
        raise PolicyInvalid({"tool": ["name a tool"]})
    if _tool_schema(tool_name) is None:
        raise PolicyInvalid({"tool": [f"no tool named {tool_name!r} is registered"]})
    version_validate(tool_name=tool_name, rules=rules, time_zone=time_zone, note=note)
    with transaction.atomic():
        policy, _ = ApprovalPolicy.objects.get_or_create(
            tool_name=tool_name,
            agent_name=agent_name or "",
            principal_group=principal_group or "",
            defaults={"created_by": actor.user},
        )
        # the policy row serialises version numbers (two drafts at once get 3 and 4)
        policy = ApprovalPolicy.objects.select_for_update().get(id=policy.id)
        last = policy.versions.order_by("-number").values_list("number", flat=True).first()
        current = policy.versions.filter(status=ApprovalPolicyVersion.Status.PUBLISHED).first()
        if based_on is not None and (current is None or current.id != based_on):
            raise PolicyConflict(
                "the published version changed since you started this draft: "
                "look at the current version and draft again"
            )
        version = ApprovalPolicyVersion.objects.create(
            policy=policy,
            number=(last or 0) + 1,
            rules=rules,
            time_zone=time_zone or "UTC",
            note=note.strip(),
            based_on=current,
            created_by=actor.user,
        )
        audit_record(
            action="policy.drafted",
            actor=actor.label,
            channel=actor.channel,
            object_type="approval_policy_version",
            object_id=version.id,
            after=_snapshot(version),
        )
    return version


def policy_version_discard(*, actor: Actor, version_id: Any) -> ApprovalPolicyVersion:
    actor.require(MANAGE)
    with transaction.atomic():
        version = ApprovalPolicyVersion.objects.select_for_update().get(id=version_id)
        if version.status != ApprovalPolicyVersion.Status.DRAFT:
            raise PolicyConflict(f"version {version.number} is {version.status}, not a draft")
        version.status = ApprovalPolicyVersion.Status.DISCARDED
        version.save(update_fields=["status"])
        audit_record(
            action="policy.discarded",
            actor=actor.label,
            channel=actor.channel,
            object_type="approval_policy_version",
            object_id=version.id,
            after=_snapshot(version),
        )
    return version


def policy_withdraw(
    *, actor: Actor, policy_id: Any, note: str, based_on: int | None = None
) -> ApprovalPolicyVersion:
    """Draft the policy's withdrawal: a version with no rules of its own that, once
    published (by another admin, like any version), takes the policy out of force — the
    next broader data policy applies to its calls, or the tool's code policy. Versioned and
    audited like any change; drafting a new version afterwards puts a policy back."""
    actor.require(MANAGE)
    if not (note or "").strip():
        raise PolicyInvalid({"note": ["say why: every version records the reason for it"]})
    if len(note) > NOTE_MAX:
        raise PolicyInvalid({"note": [f"at most {NOTE_MAX} characters"]})
    with transaction.atomic():
        try:
            policy = ApprovalPolicy.objects.select_for_update().get(id=policy_id)
        except ApprovalPolicy.DoesNotExist:
            raise NotFound("no such policy") from None
        current = policy.versions.filter(status=ApprovalPolicyVersion.Status.PUBLISHED).first()
        if current is None or current.withdraws:
            raise PolicyConflict(
                "nothing to withdraw: no version of this policy is in force "
                "(the tool's code policy applies already)"
            )
        if based_on is not None and current.id != based_on:
            raise PolicyConflict("the published version changed since you looked at it: look again")
        last = policy.versions.order_by("-number").values_list("number", flat=True).first()
        version = ApprovalPolicyVersion.objects.create(
            policy=policy,
            number=(last or 0) + 1,
            rules=[],
            time_zone=current.time_zone,
            note=note.strip(),
            based_on=current,
            created_by=actor.user,
            withdraws=True,
        )
        audit_record(
            action="policy.withdrawal_drafted",
            actor=actor.label,
            channel=actor.channel,
            object_type="approval_policy_version",
            object_id=version.id,
            before=_snapshot(current),
            after=_snapshot(version),
        )
    return version


@dataclass
class Republished:
    """What publishing did to the tool's open approvals."""

    rerequested: list[int] = field(default_factory=list)
    denied: list[int] = field(default_factory=list)
    still_pending: list[int] = field(default_factory=list)


def policy_version_publish(
    *, actor: Actor, version_id: Any, request: Any = None
) -> tuple[ApprovalPolicyVersion, Republished]:
    """Make a draft the policy's current version. Needs a second person: whoever drafted
    it cannot publish it (the separation of duties approvals have). The version it was
    drafted against must still be the current one (``PolicyConflict`` otherwise).

    In the same transaction every pending approval of the tool is checked against the new
    version on the facts its call was decided with: one that asks less than the new rules
    (fewer approvers, another group) is cancelled and asked again (``policy_changed``);
    a call the new rules deny is rejected with the policy's reason; one the new rules would
    let through stays pending — a looser policy never approves anything by itself.
    Approved calls not yet dispatched are re-checked by the dispatch itself."""
    actor.require(MANAGE)
    user = actor.user
    if user is None:
        raise PermissionDenied("policies are published by people")
    with transaction.atomic():
        version = (
            ApprovalPolicyVersion.objects.select_for_update()
            .select_related("policy")
            .get(id=version_id)
        )
        if version.status != ApprovalPolicyVersion.Status.DRAFT:
            raise PolicyConflict(f"version {version.number} is {version.status}, not a draft")
        if version.created_by_id == user.pk:
            raise SeparationOfDuties(
                "you drafted this version: another person with the admin role publishes it"
            )
        policy = ApprovalPolicy.objects.select_for_update().get(id=version.policy_id)
        current = policy.versions.filter(status=ApprovalPolicyVersion.Status.PUBLISHED).first()
        if (current.id if current else None) != version.based_on_id:
            raise PolicyConflict(
                f"version {current.number if current else '?'} was published after this draft "
                "was written: publishing it would undo that change; draft again from it"
            )
        # the rules are validated again: a group may have been deleted since (a withdrawal
        # has none)
        version_validate(
            tool_name=policy.tool_name,
            rules=version.rules,
            time_zone=version.time_zone,
            note=version.note,
        )
        if current is not None:
            current.status = ApprovalPolicyVersion.Status.SUPERSEDED
            current.save(update_fields=["status"])
        version.status = ApprovalPolicyVersion.Status.PUBLISHED
        version.published_by = user
        version.published_at = timezone.now()
        version.save(update_fields=["status", "published_by", "published_at"])
        audit_record(
            action="policy.withdrawn" if version.withdraws else "policy.published",
            actor=actor.label,
            channel=actor.channel,
            request=request,
            object_type="approval_policy_version",
            object_id=version.id,
            before=_snapshot(current) if current else None,
            after=_snapshot(version),
        )
        done = _recheck_pending(policy.tool_name, actor=actor)
    return version, done


def _recheck_pending(tool_name: str, *, actor: Actor) -> Republished:
    done = Republished()
    # no claim precedes this: read the generations so the principals' groups are current
    configcache.refresh()
    try:
        tool = registry.tool(tool_name)
    except UnknownTool:
        tool = None
    pending = list(
        Approval.objects.filter(tool_name=tool_name, status=Approval.Status.PENDING)
        .order_by("id")
        .values_list("id", "run_id")
    )
    for approval_id, run_id in pending:
        with checkpoint(run_id, actor=actor.label, channel=actor.channel) as cp:
            approval = Approval.objects.select_for_update().get(id=approval_id)
            if approval.status != Approval.Status.PENDING:
                continue
            call = ToolCall.objects.select_related("step").get(id=approval.tool_call_id)
            facts = call.policy_input or policy_facts(cp.run)
            version = current_version(
                tool_name, agent=facts.get("agent", ""), groups=facts.get("groups", ())
            )
            if version is not None:
                verdict = verdict_of(
                    version, tool_name=tool_name, arguments=call.arguments, facts=facts
                )
                requirement = verdict.requirement
                why = f"version {version.number}"
            elif approval.policy_version_id is not None and tool is not None:
                # asked by a data policy that is no longer in force (withdrawn): the
                # tool's code policy governs it now
                verdict = code_verdict(tool, call.arguments)
                requirement = code_requirement(tool)
                why = "the data policy was withdrawn: the code policy applies"
            else:
                continue  # the code policy asked, and still governs: nothing changed
            if verdict.outcome == Verdict.ALLOW or (
                verdict.needs_approval and pending_satisfies(approval, requirement)
            ):
                done.still_pending.append(approval.id)
                continue
            approval.status = Approval.Status.CANCELLED
            approval.reason = f"policy_changed: {why}"
            approval.save(update_fields=["status", "reason"])
            # whose decisions this voids: they are not carried over to the new request
            voided = voided_decisions(approval)
            cp.event(
                EventType.APPROVAL_CANCELLED,
                approval=approval.id,
                reason="policy_changed",
                policy_version=version.id if version is not None else None,
                voided=voided,
            )
            if verdict.denied:
                toolcall_gate_settled(
                    cp=cp, call=call, approved=False, reason=f"denied by policy: {verdict.reason}"
                )
                done.denied.append(approval.id)
                continue
            fresh = approval_create(
                cp=cp,
                call=call,
                tool=tool,
                requirement=requirement if version is not None else None,
                version_id=version.id if version is not None else None,
                replaces=approval.id,
                why=approval.reason,
                voided=voided,
            )
            done.rerequested.append(fresh.id)
    return done


# --- simulation ------------------------------------------------------------------------------


class Change:
    NEWLY_REQUIRES = "newly_requires_approval"
    NEWLY_DENIED = "newly_denied"
    NO_LONGER_REQUIRES = "no_longer_requires_approval"
    NO_LONGER_DENIED = "no_longer_denied"
    REQUIREMENT_CHANGED = "requirement_changed"
    UNCHANGED = "unchanged"

    LABELS = {
        NEWLY_REQUIRES: "would newly need approval",
        NEWLY_DENIED: "would be denied",
        NO_LONGER_REQUIRES: "would no longer need approval",
        NO_LONGER_DENIED: "would no longer be denied",
        REQUIREMENT_CHANGED: "would need other approvers",
        UNCHANGED: "unchanged",
    }


@dataclass(frozen=True)
class SimulatedCall:
    call_id: int
    run_id: Any
    idempotency_key: str
    arguments_masked: dict[str, Any]
    # the call as people read it ("Refund 200.00 EUR to order ord_1004"), masked
    summary: str
    decided_at: str
    principal: str
    spend: str
    # what the policy in force today says ("before") and which policy that is
    before: str
    before_policy: str
    after: str
    change: str
    reconstructed: bool
    dry_run: bool = False


@dataclass
class Simulation:
    version_id: Any
    tool_name: str
    days: int
    since: Any
    compared_with: str
    calls: list[SimulatedCall]
    counts: dict[str, int]
    truncated: bool
    limit: int = SIMULATE_MAX_CALLS

    @property
    def changed(self) -> list[SimulatedCall]:
        return [c for c in self.calls if c.change != Change.UNCHANGED]

    @property
    def truncation_note(self) -> str:
        """Said wherever the result is shown: a capped replay is never silent."""
        if not self.truncated:
            return ""
        return (
            f"only the newest {self.limit:,} calls were replayed: older calls of the period "
            "were not (shorten the period to see them all)"
        )

    def as_dict(self) -> dict[str, Any]:
        return {
            "version": self.version_id,
            "tool": self.tool_name,
            "days": self.days,
            "since": self.since.isoformat(),
            "compared_with": self.compared_with,
            "counts": self.counts,
            "calls_replayed": len(self.calls),
            "truncated": self.truncated,
            "limit": self.limit,
            "truncation_note": self.truncation_note,
            "changed": [c.__dict__ for c in self.changed],
        }


def _classify(before: tuple, after: tuple) -> str:
    if before == after:
        return Change.UNCHANGED
    b, a = before[0], after[0]
    if a == "deny":
        return Change.NEWLY_DENIED
    if b == "deny":
        return Change.NO_LONGER_DENIED if a == "allow" else Change.NEWLY_REQUIRES
    if a == "require_approval" and b == "allow":
        return Change.NEWLY_REQUIRES
    if a == "allow":
        return Change.NO_LONGER_REQUIRES
    return Change.REQUIREMENT_CHANGED


def policy_simulate(*, actor: Actor, version_id: Any, days: int = 7) -> Simulation:
    """Replay the tool's calls of the last ``days`` days against a version: each call is
    evaluated on the facts recorded when it was decided (principal, groups, spend so far,
    time) by the policy in force today for that call — the most specific published data
    policy that reaches it, or the tool's code policy — and by the policies as they would
    be with ``version`` published (a withdrawal: without this policy), and the differences
    are listed. Calls decided before facts were recorded are evaluated on what the record
    still has (the run's principal today, the call's time, no spend) and marked
    ``reconstructed``. At most ``SIMULATE_MAX_CALLS`` calls, the newest, are replayed
    (``truncated`` says so). Reads only; the result's counts are kept on the draft for the
    publish page."""
    actor.require(MANAGE)
    if not isinstance(days, int) or not 1 <= days <= SIMULATE_MAX_DAYS:
        raise InvalidInput(f"days must be a whole number from 1 to {SIMULATE_MAX_DAYS}")
    version = ApprovalPolicyVersion.objects.select_related("policy").get(id=version_id)
    simulation = simulate(version, days=days)
    if version.status == ApprovalPolicyVersion.Status.DRAFT:
        version.simulated = {
            "at": timezone.now().isoformat(),
            "by": actor.label,
            "days": days,
            "calls": len(simulation.calls),
            "counts": simulation.counts,
            "compared_with": simulation.compared_with,
            "truncated": simulation.truncated,
            "truncation_note": simulation.truncation_note,
        }
        version.save(update_fields=["simulated"])
    return simulation


def policy_rules_simulate(
    *,
    actor: Actor,
    tool_name: str,
    rules: Any,
    time_zone: str = "UTC",
    agent_name: str = "",
    principal_group: str = "",
    days: int = 7,
) -> Simulation:
    """Simulate rules that are not written as a version yet (``policy_simulate --rules``,
    the API): validated like a draft, compared with the policy in force now; nothing is
    written."""
    actor.require(MANAGE)
    if not isinstance(days, int) or not 1 <= days <= SIMULATE_MAX_DAYS:
        raise InvalidInput(f"days must be a whole number from 1 to {SIMULATE_MAX_DAYS}")
    if _tool_schema(tool_name) is None:
        raise PolicyInvalid({"tool": [f"no tool named {tool_name!r} is registered"]})
    version_validate(tool_name=tool_name, rules=rules, time_zone=time_zone, note="(simulation)")
    policy = ApprovalPolicy.objects.filter(
        tool_name=tool_name, agent_name=agent_name, principal_group=principal_group
    ).first() or ApprovalPolicy(
        tool_name=tool_name, agent_name=agent_name, principal_group=principal_group
    )
    unsaved = ApprovalPolicyVersion(policy=policy, number=0, rules=rules, time_zone=time_zone)
    return simulate(unsaved, days=days)


def _label(version: ApprovalPolicyVersion | None, policy: ApprovalPolicy) -> str:
    if version is None:
        return "the code policy"
    if version.policy_id == policy.pk:
        return f"version {version.number}"
    return (
        f"version {version.number} of the policy{version.policy.scope_label or ' for every agent'}"
    )


def simulate(version: ApprovalPolicyVersion, *, days: int) -> Simulation:
    policy = version.policy
    tool_name = policy.tool_name
    try:
        tool = registry.tool(tool_name)
    except UnknownTool:
        tool = None
    published = list(
        ApprovalPolicyVersion.objects.filter(
            status=ApprovalPolicyVersion.Status.PUBLISHED, policy__tool_name=tool_name
        ).select_related("policy")
    )
    others = [v for v in published if policy.pk is None or v.policy_id != policy.pk]
    own = next((v for v in published if policy.pk is not None and v.policy_id == policy.pk), None)
    if own is not None and own.id == version.id:
        # the published version itself: compared with the one it replaced
        own = version.based_on
    # today's policies, and the same with this version in force (a withdrawal: without
    # this policy); each call is governed by the most specific one that reaches it
    today = others + ([own] if own is not None else [])
    proposed = others + ([version] if not version.withdraws else [])
    scope_groups = [policy.principal_group] if policy.principal_group else []
    compared_with = _label(
        most_specific(today, agent=policy.agent_name, groups=scope_groups), policy
    )
    since = timezone.now() - timedelta(days=days)
    rows = (
        ToolCall.objects.filter(tool_name=tool_name, created_at__gte=since)
        .select_related("run__principal")
        .order_by("-created_at")
    )
    if policy.agent_name:
        rows = rows.filter(run__agent_name=policy.agent_name)
    calls = list(rows[: SIMULATE_MAX_CALLS + 1])
    truncated = len(calls) > SIMULATE_MAX_CALLS
    calls = calls[:SIMULATE_MAX_CALLS]
    group_cache: dict[Any, list[str]] = {}
    results: list[SimulatedCall] = []
    counts: Counter[str] = Counter()
    for call in calls:
        facts = call.policy_input
        reconstructed = not facts
        if reconstructed:
            principal = call.run.principal
            if principal is not None and principal.pk not in group_cache:
                group_cache[principal.pk] = sorted(principal.groups.values_list("name", flat=True))
            facts = {
                "principal": principal.get_username() if principal else "",
                "groups": group_cache.get(principal.pk, []) if principal else [],
                "agent": call.run.agent_name,
                "spend": "0",
                "at": call.created_at.isoformat(),
            }
        if policy.principal_group and policy.principal_group not in facts.get("groups", []):
            continue  # the policy's scope does not reach this call's principal
        agent, groups = facts.get("agent", ""), facts.get("groups", ())
        in_force = most_specific(today, agent=agent, groups=groups)
        before_v = _verdict(in_force, tool, tool_name, call.arguments, facts)
        after_v = _verdict(
            most_specific(proposed, agent=agent, groups=groups),
            tool,
            tool_name,
            call.arguments,
            facts,
        )
        change = _classify(_key(before_v, tool), _key(after_v, tool))
        counts[change] += 1
        results.append(
            SimulatedCall(
                call_id=call.id,
                run_id=call.run_id,
                idempotency_key=call.idempotency_key,
                arguments_masked=call.arguments_masked,
                summary=call_summary(tool_name, call.arguments_masked),
                decided_at=str(facts.get("at", "")),
                principal=str(facts.get("principal", "")),
                spend=str(facts.get("spend", "")),
                before=_describe(before_v, tool),
                before_policy=_label(in_force, policy),
                after=_describe(after_v, tool),
                change=change,
                reconstructed=reconstructed,
                dry_run=call.run.dry_run,
            )
        )
    return Simulation(
        version_id=version.id,
        tool_name=tool_name,
        days=days,
        since=since,
        compared_with=compared_with,
        calls=results,
        counts={key: counts.get(key, 0) for key in Change.LABELS},
        truncated=truncated,
        limit=SIMULATE_MAX_CALLS,
    )


def _verdict(
    version: ApprovalPolicyVersion | None, tool: Any, tool_name: str, arguments: Any, facts: Any
) -> Verdict:
    if version is not None:
        return verdict_of(version, tool_name=tool_name, arguments=arguments, facts=facts)
    if tool is not None:
        return code_verdict(tool, arguments)
    return Verdict(Verdict.ALLOW)


def _requirement(verdict: Verdict, tool: Any) -> policies.Requirement | None:
    if verdict.requirement is not None:
        return verdict.requirement
    return code_requirement(tool) if tool is not None else None


def _key(verdict: Verdict, tool: Any) -> tuple:
    if not verdict.needs_approval:
        return (verdict.outcome,)
    req = _requirement(verdict, tool)
    if req is None:
        return (verdict.outcome,)
    return (verdict.outcome, req.group, req.required, req.from_groups)


def _describe(verdict: Verdict, tool: Any) -> str:
    if verdict.denied:
        return f"deny ({verdict.reason})" if verdict.reason else "deny"
    if verdict.needs_approval:
        req = _requirement(verdict, tool)
        return f"require approval ({req.describe()})" if req else "require approval"
    return "allow"

"""Approval decisions. The web pages, email links, API and admin all call these."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from django.conf import settings
from django.db import transaction
from django.db.models import F
from django.db.models.functions import Now
from django.utils import timezone

from approvals import notify, quorum, selectors
from approvals.models import Approval, ApprovalDecision, ApprovalLink
from runs import links
from runs.actors import Actor, PermissionDenied
from runs.dbtime import db_now
from runs.errors import DomainError
from runs.masking import UNMASKED, maskers_for_ids
from runs.models import Run, ToolCall
from runs.record.checkpoint import checkpoint
from runs.record.eventtypes import EventType
from runs.registry import UnknownTool, digest, registry
from runs.services import InvalidInput, InvalidState, toolcall_gate_settled

MASKED = "***"


class AlreadyDecided(DomainError):
    code = "already_decided"
    status = 409


class ApprovalExpired(DomainError):
    code = "approval_expired"
    status = 409


class InvalidArguments(InvalidInput):
    """Edited arguments that the tool's schema refuses; nothing was changed."""

    def __init__(self, message: str, errors: list[str] | None = None) -> None:
        super().__init__(message)
        self.errors = errors or [message]
        self.fields = {"arguments": self.errors}


@dataclass(frozen=True)
class _Edit:
    based_on_digest: str
    arguments: dict[str, Any]
    masked: dict[str, Any]
    digest: str
    fingerprint: str


def _prepare_edit(tool_call_id: Any, edited: Any) -> _Edit | None:
    """Validate an edit against the tool's schema and compute what binds it, before any
    lock is taken (a precondition lookup may do I/O). ``"***"`` in a sensitive field means
    "keep the value I could not see". None when the edit changes nothing."""
    if not isinstance(edited, dict):
        raise InvalidArguments("the arguments must be a JSON object")
    call = ToolCall.objects.only(
        "run_id", "tool_name", "tool_version", "arguments", "arguments_digest"
    ).get(id=tool_call_id)
    try:
        tool = registry.tool(call.tool_name)
    except UnknownTool:
        raise InvalidArguments(f"tool {call.tool_name!r} is no longer registered") from None
    if not tool.accepts(call.tool_version):
        raise InvalidArguments(f"tool {call.tool_name!r} changed since the call was proposed")
    arguments = dict(edited)
    for name in tool.sensitive_fields:
        if arguments.get(name) == MASKED and name in call.arguments:
            arguments[name] = call.arguments[name]
    # Likewise a field shown with a run's sensitive tool output masked (runs.masking) and
    # sent back as shown keeps its real value: the approver edited something else.
    origin = maskers_for_ids([call.run_id]).get(call.run_id, UNMASKED)
    for name, value in call.arguments.items():
        if name in arguments and arguments[name] != value and arguments[name] == origin(value):
            arguments[name] = value
    errors = tool.validate(arguments)
    if errors:
        raise InvalidArguments(
            "the edited arguments do not match the tool's schema: " + "; ".join(errors), errors
        )
    new_digest = digest(arguments)
    if new_digest == call.arguments_digest:
        return None
    return _Edit(
        based_on_digest=call.arguments_digest,
        arguments=arguments,
        masked=tool.mask(arguments),
        digest=new_digest,
        fingerprint=tool.precondition(arguments) if tool.precondition else "",
    )


def approval_decide(
    *,
    approval_id: Any,
    decision: str,
    actor: Actor,
    comment: str = "",
    edited_arguments: dict[str, Any] | None = None,
) -> Approval:
    """Record one person's decision. First decision wins; a decision after the approval
    settled, or a second one by the same person, raises ``AlreadyDecided`` and changes
    nothing. Expiry is checked under the lock, whatever the sweeper has done.

    ``comment`` as the decision records a remark and decides nothing. ``edited_arguments``
    (with ``approve``) replaces the call's arguments: validated against the tool's schema
    (``InvalidArguments``, nothing changed), the digest recomputed, and the call and the
    approval rebound to it in the same transaction, so the dispatch consumes exactly what
    was approved. The masked original is kept beside the masked edit."""
    if decision not in ApprovalDecision.Decision.values:
        raise ValueError(f"decision must be one of {ApprovalDecision.Decision.values}")
    if edited_arguments is not None and decision != ApprovalDecision.Decision.APPROVE:
        raise InvalidArguments("only an approval can carry edited arguments")
    user = actor.user
    if user is None:
        raise PermissionDenied("approvals are decided by people")
    actor.require("approvals.decide_approval")
    run_id, tool_call_id = Approval.objects.values_list("run_id", "tool_call_id").get(
        id=approval_id
    )
    edit = _prepare_edit(tool_call_id, edited_arguments) if edited_arguments is not None else None
    # atomic() around the checkpoint: called inside a caller's transaction (an email link's,
    # a test's), a refusal rolls back to a savepoint and leaves that transaction usable
    with transaction.atomic(), checkpoint(run_id, actor=actor.label, channel=actor.channel) as cp:
        approval = Approval.objects.select_for_update().get(id=approval_id)
        if approval.status != Approval.Status.PENDING:
            raise AlreadyDecided(f"this approval is already {approval.status}")
        if not Approval.objects.filter(id=approval.id, expires_at__gt=Now()).exists():
            raise ApprovalExpired("this approval has expired and can no longer be decided")
        eligible = approval.eligible_groups
        if not user.is_superuser and not user.groups.filter(name__in=eligible).exists():
            raise PermissionDenied(f"only members of {' or '.join(eligible)} may decide")
        conflict = selectors.duty_conflict(
            user=user, approval=approval, principal_id=cp.run.principal_id
        )
        if conflict:
            raise PermissionDenied(conflict)
        if decision == ApprovalDecision.Decision.COMMENT:
            if not comment.strip():
                raise InvalidInput("a comment needs some text")
            ApprovalDecision.objects.create(
                approval=approval,
                decider=user,
                channel=actor.channel,
                decision=decision,
                comment=comment,
            )
            cp.event(
                EventType.APPROVAL_COMMENTED, approval=approval.id, by=actor.label, comment=comment
            )
            return approval
        if approval.decisions.filter(decider=user, decision__in=ApprovalDecision.DECIDING).exists():
            raise AlreadyDecided("you have already decided this approval")
        approvers: list[quorum.Approver] = []
        if decision == ApprovalDecision.Decision.APPROVE and approval.group_minimums:
            # only where a rule set group minimums: who approved so far, with their groups
            from approvals.gate import approvers_of

            approvers = approvers_of(approval)
            me = quorum.Approver(
                key=user.pk,
                groups=frozenset(user.groups.values_list("name", flat=True)),
                superuser=user.is_superuser,
            )
            why = quorum.refusal(
                approvers,
                me,
                group=approval.approver_group,
                required=approval.required_count + (1 if edit is not None else 0),
                minimums=approval.group_minimums,
            )
            if why:
                raise PermissionDenied(why[0].upper() + why[1:])
            approvers = [*approvers, me]
        call = ToolCall.objects.select_related("step").get(id=approval.tool_call_id)
        edit_payload: dict[str, Any] = {}
        if edit is not None:
            edit_payload = _apply_edit(approval, call, edit)
            # an edit counts as its author's approval, and one more person must approve
            # what they changed: one approver never edits the target or amount alone
            approval.required_count += 1
            approval.save(update_fields=["required_count"])
            edit_payload["required_raised_by_edit"] = True
        ApprovalDecision.objects.create(
            approval=approval,
            decider=user,
            channel=actor.channel,
            decision=decision,
            comment=comment,
            edited_arguments=edit.masked if edit else None,
            original_arguments=edit_payload.get("original_arguments"),
            original_digest=edit_payload.get("original_digest", ""),
            edited_digest=edit.digest if edit else "",
        )
        approvals = approval.decisions.filter(decision=ApprovalDecision.Decision.APPROVE).count()
        if approval.group_minimums:
            # who approved, matched to the groups' minimums (approvals.quorum)
            standing = quorum.assess(
                approvers if decision == ApprovalDecision.Decision.APPROVE else [],
                group=approval.approver_group,
                required=approval.required_count,
                minimums=approval.group_minimums,
            )
            quorum_met = standing.met
            needs = {"needs": standing.missing} if standing.missing else {}
        else:
            quorum_met, needs = approvals >= approval.required_count, {}
        settled = decision == ApprovalDecision.Decision.REJECT or quorum_met
        cp.event(
            EventType.APPROVAL_DECIDED,
            approval=approval.id,
            decision=decision,
            by=actor.label,
            comment=comment,
            approvals=approvals,
            required=approval.required_count,
            settled=settled,
            **needs,
            **edit_payload,
        )
        if settled:
            approved = decision == ApprovalDecision.Decision.APPROVE
            approval.status = Approval.Status.APPROVED if approved else Approval.Status.REJECTED
            approval.decided_at = timezone.now()
            approval.reason = comment
            approval.save(update_fields=["status", "decided_at", "reason"])
            try:
                toolcall_gate_settled(cp=cp, call=call, approved=approved, reason=comment)
            except InvalidState as exc:
                raise AlreadyDecided(str(exc)) from None
            if not approved:
                notify.principal_notice_enqueue(
                    approval=approval, principal=cp.run.principal, what="rejected"
                )
    return approval


def _apply_edit(approval: Approval, call: ToolCall, edit: _Edit) -> dict[str, Any]:
    """Under the run lock: rebind the call and its approval to the edited arguments."""
    if call.arguments_digest != edit.based_on_digest:
        raise AlreadyDecided("the call's arguments changed while you edited them")
    if approval.decisions.filter(decision=ApprovalDecision.Decision.APPROVE).exists():
        # the others approved the arguments as they were, not this edit
        raise InvalidArguments(
            "others have already approved these arguments; reject instead to change them"
        )
    original = {
        "original_arguments": call.arguments_masked,
        "original_digest": call.arguments_digest,
    }
    call.arguments = edit.arguments
    call.arguments_masked = edit.masked
    call.arguments_digest = edit.digest
    call.precondition_fingerprint = edit.fingerprint
    call.save(
        update_fields=[
            "arguments",
            "arguments_masked",
            "arguments_digest",
            "precondition_fingerprint",
            "updated_at",
        ]
    )
    approval.arguments_masked = edit.masked
    approval.arguments_digest = edit.digest
    approval.precondition_fingerprint = edit.fingerprint
    approval.save(
        update_fields=["arguments_masked", "arguments_digest", "precondition_fingerprint"]
    )
    return {
        **original,
        "edited": True,
        "edited_arguments": edit.masked,
        "arguments_digest": edit.digest,
    }


# --- email links ---------------------------------------------------------------------------


def _bearer_allowed(link: ApprovalLink) -> bool:
    # a token alone decides only where the policy opted into bearer links for a 1-of-1
    # approval (an edit may have raised the count since)
    return not link.approval.require_login and link.approval.required_count <= 1


# what an approval link has of its own (runs.links holds the rest; its page: approvals.views)
APPROVAL_LINKS = links.register(
    links.LinkKind(
        name="approval",
        model=ApprovalLink,
        subject="approval",
        recipient="approver",
        related=("approval__run", "approver"),
        login_required_message="this approval requires you to sign in before deciding",
        bearer_allowed=_bearer_allowed,
        event_fields=lambda link: {"approval": link.approval_id, "kind": link.kind},
    )
)


def approval_link_get(token: str) -> ApprovalLink:
    """The link this token belongs to, or ``runs.links.LinkInvalid``."""
    return links.link_get(APPROVAL_LINKS, token)


def approval_link_decide(
    *,
    token: str,
    decision: str,
    comment: str = "",
    user: Any = None,
    client_ip: str = "",
    user_agent: str = "",
) -> Approval:
    """Decide through an emailed link (POST only), through ``runs.links.link_use``: the link
    is used up in the same transaction as the decision, so a decision that is refused leaves
    it unused and a second use of it decides nothing. The link's approver is the actor,
    channel ``email``; where the request came from is recorded with the link's use."""
    if decision not in ApprovalDecision.DECIDING:
        raise ValueError("a link can approve or reject")

    def decide(link: ApprovalLink, actor: Actor) -> Approval:
        return approval_decide(
            approval_id=link.approval_id, decision=decision, actor=actor, comment=comment
        )

    return links.link_use(
        APPROVAL_LINKS,
        token=token,
        user=user,
        act=decide,
        client_ip=client_ip,
        user_agent=user_agent,
    )


def approvals_expire_due(*, limit: int = 200) -> int:
    """Apply the on-expiry action of every pending approval past ``expires_at`` (the
    sweeper calls this every pass, so expiry during downtime is applied on recovery).
    ``reject``: the agent sees a rejection; ``terminate``: the run ends
    (``approval_expired``); ``escalate``: the approval is cancelled and a new one is
    requested from the policy's escalation group with a new expiry."""
    due = list(
        Approval.objects.filter(status=Approval.Status.PENDING, expires_at__lte=Now())
        .order_by("expires_at")
        .values_list("id", "run_id")[:limit]
    )
    for approval_id, run_id in due:
        _expire_one(approval_id, run_id)
    return len(due)


def _expire_one(approval_id: Any, run_id: Any) -> None:
    from runs.record.runs import run_terminate as apply_terminate

    actor = Actor.system()
    with checkpoint(run_id, actor=actor.label, channel=actor.channel) as cp:
        approval = Approval.objects.select_for_update().get(id=approval_id)
        if approval.status != Approval.Status.PENDING or approval.expires_at > timezone.now():
            return  # decided or extended meanwhile
        approval.status = Approval.Status.EXPIRED
        approval.decided_at = timezone.now()
        approval.reason = f"expired at {approval.expires_at.isoformat()}"
        approval.save(update_fields=["status", "decided_at", "reason"])
        cp.event(EventType.APPROVAL_EXPIRED, approval=approval.id, on_expiry=approval.on_expiry)
        notify.principal_notice_enqueue(
            approval=approval, principal=cp.run.principal, what="expired"
        )
        call = ToolCall.objects.select_related("step").get(id=approval.tool_call_id)
        if approval.on_expiry == Approval.OnExpiry.TERMINATE:
            apply_terminate(
                cp,
                by=actor.label,
                reason="approval expired",
                reason_code=Run.Reason.APPROVAL_EXPIRED,
            )
            return
        if approval.on_expiry == Approval.OnExpiry.ESCALATE:
            group, ttl_seconds = _escalation(approval)
            if group and approval.approver_group != group:
                approval.status = Approval.Status.CANCELLED
                approval.reason = f"escalated to {group}"
                approval.save(update_fields=["status", "reason"])
                escalated = Approval.objects.create(
                    run_id=approval.run_id,
                    tool_call=call,
                    tool_name=approval.tool_name,
                    tool_version=approval.tool_version,
                    arguments_digest=approval.arguments_digest,
                    precondition_fingerprint=approval.precondition_fingerprint,
                    arguments_masked=approval.arguments_masked,
                    approver_group=group,
                    required_count=approval.required_count,
                    # the groups' minimums stay: escalation changes who else may decide,
                    # not how many of finance (say) must approve
                    group_minimums=approval.group_minimums,
                    allow_self_approval=approval.allow_self_approval,
                    require_login=approval.require_login,
                    separate_duties=approval.separate_duties,
                    on_expiry=Approval.OnExpiry.REJECT,
                    # a fresh time to live from the policy, on the database's clock
                    escalate_to=group,
                    ttl_seconds=ttl_seconds,
                    expires_at=db_now() + timedelta(seconds=ttl_seconds),
                    policy_version_id=approval.policy_version_id,
                )
                cp.event(
                    EventType.APPROVAL_REQUESTED,
                    approval=escalated.id,
                    seq=call.step.seq,
                    tool=call.tool_name,
                    arguments=call.arguments_masked,
                    group=group,
                    escalated_from=approval.id,
                    expires_at=escalated.expires_at.isoformat(),
                )
                notify.links_create_and_email(approval=escalated, principal_id=cp.run.principal_id)
                return
        if call.status == ToolCall.Status.AWAITING_APPROVAL:
            toolcall_gate_settled(cp=cp, call=call, approved=False, reason="approval_expired")


def _escalation(approval: Approval) -> tuple[str, int]:
    """Whom an expired approval escalates to, and for how long: the policy copied onto
    the approval when it was requested. An approval requested before the policy was copied
    falls back to the code's current policy (nothing else is known of the old one)."""
    if approval.ttl_seconds is not None:
        return approval.escalate_to, approval.ttl_seconds
    try:
        policy = registry.tool(approval.tool_name).approval
    except UnknownTool:
        return "", 0
    return policy.escalate_to, policy.ttl_seconds


def approvals_remind_due(*, limit: int = 200) -> int:
    """Remind the approvers of every pending approval that expires within
    ``APPROVAL_REMINDER_BEFORE`` seconds, once (a sweep hook). Each gets a fresh link: the
    first one's token was never stored. Approvals that live shorter than the window are not
    reminded (the request itself was the reminder)."""
    before = settings.AGENTOPS["APPROVAL_REMINDER_BEFORE"]
    if before <= 0:
        return 0
    window = timedelta(seconds=before)
    due = list(
        Approval.objects.filter(
            status=Approval.Status.PENDING,
            reminder_sent_at__isnull=True,
            expires_at__gt=Now(),
            expires_at__lte=Now() + window,
            requested_at__lt=F("expires_at") - window,
        )
        .order_by("expires_at")
        .values_list("id", "run_id")[:limit]
    )
    reminded = 0
    for approval_id, run_id in due:
        with checkpoint(run_id, actor="system", channel=notify.EMAIL_CHANNEL) as cp:
            # a conditional UPDATE: two sweepers at once remind once
            if not Approval.objects.filter(
                id=approval_id, status=Approval.Status.PENDING, reminder_sent_at__isnull=True
            ).update(reminder_sent_at=Now()):
                continue
            approval = Approval.objects.get(id=approval_id)
            count = notify.links_create_and_email(
                approval=approval,
                principal_id=cp.run.principal_id,
                kind=ApprovalLink.Kind.REMINDER,
            )
            cp.event(EventType.APPROVAL_REMINDER_DUE, approval=approval_id, recipients=count)
            reminded += 1
    return reminded

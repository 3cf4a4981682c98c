"""HTML pages for approvals: the inbox, the detail page with the decision form, and what
the landing page of emailed links has of its own (the rest: ``runs.views.links``). Views
stay thin: parse, call a selector or a service, render.

Every state change is a POST with CSRF. The email link's GET only renders a page with
buttons: mail scanners and link previews open links, and must decide nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from django import forms
from django.contrib import messages
from django.contrib.auth.decorators import login_required, permission_required
from django.http import Http404, HttpRequest, HttpResponse
from django.shortcuts import redirect, render
from django.utils import timezone
from django.views.decorators.http import require_POST
from django_htmx.middleware import HtmxDetails

from approvals import selectors
from approvals.gate import quorum_of
from approvals.models import Approval, ApprovalDecision, ApprovalLink
from approvals.policies import describe_quorum
from approvals.services import (
    APPROVAL_LINKS,
    AlreadyDecided,
    ApprovalExpired,
    InvalidArguments,
    approval_decide,
    approval_link_decide,
)
from runs import jsonlimits
from runs.actors import Actor, PermissionDenied
from runs.forms import UnclippedCharField, choice_field
from runs.masking import masker_for, maskers_for
from runs.models import Step
from runs.registry import argument_rows, call_summary
from runs.services import InvalidInput
from runs.views.links import LinkFormError, LinkPage, after_sign_in_view, client_of, link_view

# what a decision's comment may hold (ApprovalDecision.comment is free text)
COMMENT_MAX = 2000


class HtmxHttpRequest(HttpRequest):
    htmx: HtmxDetails


@dataclass(frozen=True)
class PendingRow:
    """An inbox row: the approval as this viewer sees it."""

    approval: Approval
    # the arguments with sensitive tool output masked for this viewer (runs.masking)
    shown_arguments: Any
    quorum_text: str
    # this viewer may decide it: buttons and a box for the bulk actions
    mine: bool
    seconds_left: int


@dataclass(frozen=True)
class StepShown:
    """A step of the run's context on the detail page: a tool call as its summary and an
    argument table (masked for the viewer), ``call_rows`` None for any other step."""

    step: Step
    call_summary: str = ""
    call_rows: list[tuple[str, str]] | None = None


# --- inbox ---------------------------------------------------------------------------------


@login_required
@permission_required("approvals.view_approval", raise_exception=True)
def approval_inbox(request: HtmxHttpRequest) -> HttpResponse:
    agent = request.GET.get("agent", "")
    tool = request.GET.get("tool", "")
    inbox = selectors.approval_inbox(user=request.user, agent=agent, tool=tool)
    now = timezone.now()
    # each row as this viewer may see it: sensitive tool output copied into the arguments
    # masked (runs.masking; one query for every run on the page)
    masks = maskers_for([a.run for a in inbox.pending], user=request.user)
    # the rows this approver may decide get buttons (and a box for the bulk actions)
    mine = {a.id for a in selectors.decidable(user=request.user, approvals=inbox.pending)}
    pending = [
        PendingRow(
            approval=approval,
            shown_arguments=masks[approval.run_id](approval.arguments_masked),
            quorum_text=_quorum_text(approval),
            mine=approval.id in mine,
            seconds_left=max(0, int((approval.expires_at - now).total_seconds())),
        )
        for approval in inbox.pending
    ]
    context = {
        "inbox": inbox,
        "decidable": len(mine),
        "bulk_limit": BULK_LIMIT,
        "pending": pending,
        "agent": agent,
        "tool": tool,
    }
    # the periodic refresh and the filter ask for the list only
    template = "approvals/inbox.html#inbox-list" if request.htmx else "approvals/inbox.html"
    return render(request, template, context)


# --- decide from the list: one or many, after a confirmation that shows each call ---------

BULK_LIMIT = 100


class BulkForm(forms.Form):
    decision = forms.ChoiceField(choices=[("approve", "Approve"), ("reject", "Reject")])
    approval = forms.TypedMultipleChoiceField(coerce=int, choices=[])
    comment = UnclippedCharField(required=False, max_length=COMMENT_MAX, widget=forms.Textarea)
    confirm = forms.BooleanField(required=False)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # any id is a valid choice here: one that is not pending, or not the approver's, is
        # listed as refused with the reason, not a form error
        ids = self.data.getlist("approval") if hasattr(self.data, "getlist") else []
        choice_field(self, "approval").choices = [(i, i) for i in ids[:BULK_LIMIT]]

    def clean_approval(self) -> list[int]:
        ids = self.cleaned_data["approval"]
        if len(ids) > BULK_LIMIT:
            raise forms.ValidationError(f"Choose at most {BULK_LIMIT} approvals at a time.")
        return list(dict.fromkeys(ids))

    def clean(self) -> dict[str, Any]:
        super().clean()
        data = self.cleaned_data
        if (
            data.get("confirm")
            and data.get("decision") == "reject"
            and not data.get("comment", "").strip()
        ):
            self.add_error("comment", "Give a reason to reject: each agent receives it.")
        return data


@login_required
@permission_required("approvals.view_approval", raise_exception=True)
@require_POST
def approval_bulk(request: HtmxHttpRequest) -> HttpResponse:
    """Approve or reject one or many approvals from the inbox. The first POST shows what
    would be decided — each call's summary and arguments, and which of them the approver
    may not decide and why — and decides nothing; the confirmed POST decides each one on
    its own through ``approval_decide`` (one refusal stops none of the others) and lists
    what happened to each."""
    form = BulkForm(request.POST)
    if not form.is_valid():
        context = {"form": form, "items": [], "stage": "invalid"}
        return render(request, "approvals/bulk.html", context, status=400)
    data = form.cleaned_data
    decision = data["decision"]
    results: dict[int, tuple[bool, str]] = {}
    if data["confirm"]:
        actor = Actor.for_user(request.user, "web")
        for approval_id in data["approval"]:
            try:
                # its own savepoint: one refusal leaves the others' decisions standing
                approval_decide(
                    approval_id=approval_id,
                    decision=decision,
                    actor=actor,
                    comment=data["comment"].strip(),
                )
            except Approval.DoesNotExist:
                results[approval_id] = (False, "No such approval.")
            except (AlreadyDecided, ApprovalExpired, PermissionDenied, InvalidInput) as exc:
                results[approval_id] = (False, str(exc))
            else:
                results[approval_id] = (True, selectors.PAST_TENSE[decision])
    approvals = list(
        Approval.objects.select_related("run")
        .filter(id__in=data["approval"])
        .order_by("expires_at", "id")
    )
    masks = maskers_for({a.run_id: a.run for a in approvals}.values(), user=request.user)
    mine = {a.id for a in selectors.decidable(user=request.user, approvals=approvals)}
    items = []
    for approval in approvals:
        shown = masks[approval.run_id](approval.arguments_masked)
        why_not = ""
        if not data["confirm"] and approval.id not in mine:
            why_not = selectors.why_not_decide(user=request.user, approval=approval)
        items.append(
            {
                "approval": approval,
                "quorum_text": _quorum_text(approval),
                "shown_arguments": shown,
                "why_not": why_not,
                "result": results.get(approval.id),
            }
        )
    context = {
        "form": form,
        "decision": decision,
        "items": items,
        "decidable": [item for item in items if not item["why_not"]],
        "stage": "done" if data["confirm"] else "review",
        "comment": data["comment"],
    }
    response = render(request, "approvals/bulk.html", context)
    if data["confirm"]:
        response["HX-Trigger"] = "runs-changed"
    return response


# --- detail + decision form ----------------------------------------------------------------


class DecisionForm(forms.Form):
    ACTIONS = [
        ("approve", "Approve"),
        ("reject", "Reject"),
        ("edit", "Approve with edited arguments"),
        ("comment", "Comment"),
    ]
    action = forms.ChoiceField(choices=ACTIONS)
    comment = UnclippedCharField(required=False, max_length=COMMENT_MAX, widget=forms.Textarea)
    arguments = forms.CharField(required=False, widget=forms.Textarea)

    def clean(self) -> dict[str, Any]:
        super().clean()
        data = self.cleaned_data
        action = data.get("action")
        if action == "reject" and not data.get("comment", "").strip():
            self.add_error("comment", "Give a reason: the agent receives it.")
        if action == "comment" and not data.get("comment", "").strip():
            self.add_error("comment", "Write a comment.")
        if action == "edit":
            try:
                edited = jsonlimits.loads(data.get("arguments") or "")
            except jsonlimits.JsonRejected as exc:
                self.add_error("arguments", f"{exc.detail}.")
            except ValueError as exc:
                self.add_error("arguments", f"Not valid JSON: {exc}")
            else:
                if not isinstance(edited, dict):
                    self.add_error("arguments", "The arguments must be a JSON object.")
                else:
                    data["edited_arguments"] = edited
        return data


def _quorum_text(approval: Approval) -> str:
    return describe_quorum(
        approval.approver_group, approval.required_count, approval.group_minimums
    )


def _arguments_json(arguments: Any) -> str:
    return jsonlimits.pretty(arguments)


def _detail(
    request: HtmxHttpRequest,
    approval_id: int,
    *,
    form: DecisionForm | None = None,
    error: str = "",
    status: int = 200,
) -> HttpResponse:
    try:
        ctx = selectors.approval_context(approval_id=approval_id)
    except Approval.DoesNotExist:
        raise Http404("no such approval") from None
    approval = ctx.approval
    mask = masker_for(approval.run, user=request.user)
    why_not = selectors.why_not_decide(user=request.user, approval=approval)
    # the run's context: each tool call step as its summary and an argument table, not a dict
    steps = []
    for step in ctx.steps:
        arguments = step.input.get("arguments") if isinstance(step.input, dict) else None
        if step.kind == "tool_call" and isinstance(arguments, dict):
            shown = mask(arguments)
            tool = step.input.get("tool", "")
            steps.append(StepShown(step, call_summary(tool, shown), argument_rows(tool, shown)))
        else:
            steps.append(StepShown(step))
    context = {
        "ctx": ctx,
        "steps": steps,
        "approval": approval,
        "run": approval.run,
        "call": ctx.call,
        "mask": mask,
        "shown_arguments": mask(approval.arguments_masked),
        "arguments_json": _arguments_json(mask(approval.arguments_masked)),
        "why_not": why_not,
        "may_decide": not why_not,
        "seconds_left": max(0, int((approval.expires_at - timezone.now()).total_seconds())),
        "form": form,
        "action": form.data.get("action") if form is not None else "",
        "error": error,
        # who must approve, where it stands ("1 of 2, needs 1 from finance"), and the
        # requests this one replaced with the decisions that no longer count
        "quorum_text": describe_quorum(
            approval.approver_group, approval.required_count, approval.group_minimums
        ),
        "standing": quorum_of(approval),
        "earlier": selectors.earlier_requests(approval),
        "later": Approval.objects.filter(tool_call_id=approval.tool_call_id, id__gt=approval.id)
        .order_by("id")
        .first()
        if approval.status == Approval.Status.CANCELLED
        else None,
    }
    template = "approvals/detail.html"
    if request.htmx:
        template += "#decision-panel"
    return render(request, template, context, status=status)


@login_required
@permission_required("approvals.view_approval", raise_exception=True)
def approval_detail(request: HtmxHttpRequest, approval_id: int) -> HttpResponse:
    return _detail(request, approval_id)


@login_required
@permission_required("approvals.view_approval", raise_exception=True)
@require_POST
def approval_decide_view(request: HtmxHttpRequest, approval_id: int) -> HttpResponse:
    form = DecisionForm(request.POST)
    if not form.is_valid():
        return _detail(request, approval_id, form=form, status=400)
    action = form.cleaned_data["action"]
    decision = ApprovalDecision.Decision.APPROVE if action == "edit" else action
    try:
        approval_decide(
            approval_id=approval_id,
            decision=decision,
            actor=Actor.for_user(request.user, "web"),
            comment=form.cleaned_data["comment"],
            edited_arguments=form.cleaned_data.get("edited_arguments"),
        )
    except Approval.DoesNotExist:
        raise Http404("no such approval") from None
    except InvalidArguments as exc:
        for message in exc.errors:
            form.add_error("arguments", message)
        return _detail(request, approval_id, form=form, status=400)
    except InvalidInput as exc:
        form.add_error(None, str(exc))
        return _detail(request, approval_id, form=form, status=400)
    except (AlreadyDecided, ApprovalExpired) as exc:
        return _detail(request, approval_id, form=form, error=str(exc), status=409)
    except PermissionDenied as exc:
        return _detail(request, approval_id, form=form, error=str(exc), status=403)
    done = {
        "approve": "You approved this call.",
        "reject": "You rejected this call.",
        "edit": "You approved this call with edited arguments.",
        "comment": "Your comment was added.",
    }[action]
    messages.success(request, done)
    if request.htmx:
        return _detail(request, approval_id)
    return redirect("approvals:detail", approval_id=approval_id)


# --- email links ---------------------------------------------------------------------------


def _link_state(link: ApprovalLink) -> str:
    approval = link.approval
    if approval.status == Approval.Status.EXPIRED:
        return "expired"
    if approval.status == Approval.Status.CANCELLED:
        return "cancelled"
    if link.used_at is not None or approval.status != Approval.Status.PENDING:
        return "decided"
    if selectors.link_decision(link=link) is not None:
        return "decided"
    if approval.expires_at <= timezone.now():
        return "expired"  # the sweeper has not got to it yet; the service refuses it anyway
    return "confirm"


def _link_context(request: HttpRequest, link: ApprovalLink) -> dict[str, Any]:
    approval = link.approval
    # a link's page may be open without a sign-in: shown as to nobody in particular
    arguments = masker_for(approval.run)(approval.arguments_masked)
    return {
        "approval": approval,
        "run": approval.run,
        # what is asked, in the words of the email's subject (issue 20, item 5)
        "summary": call_summary(approval.tool_name, arguments),
        "arguments_json": _arguments_json(arguments),
        "decisions": list(approval.decisions.select_related("decider")),
    }


def _link_decide(request: HttpRequest, token: str) -> Approval:
    decision = request.POST.get("decision", "")
    comment = request.POST.get("comment", "").strip()
    if decision not in ApprovalDecision.DECIDING:
        raise LinkFormError("Choose Approve or Reject.")
    if len(comment) > COMMENT_MAX or "\x00" in comment:
        # never cut silently: the approver sees why, and nothing is decided
        raise LinkFormError(
            f"The comment must be at most {COMMENT_MAX} characters, without NUL characters."
        )
    if decision == ApprovalDecision.Decision.REJECT and not comment:
        raise LinkFormError("Give a reason to reject: the agent receives it.")
    if request.POST.get("confirm") != "yes":
        # a mail scanner or a prefetching browser that submits the page's form as it is
        # decides nothing: a person ticks the box
        raise LinkFormError("Tick the box to confirm that you have read what you are deciding.")
    return approval_link_decide(
        token=token, decision=decision, comment=comment, user=request.user, **client_of(request)
    )


# what an approval's emailed link has of its own (the rest: runs.views.links)
APPROVAL_LINK_PAGE = LinkPage(
    kind=APPROVAL_LINKS,
    template="approvals/link.html",
    done="decided",
    after_sign_in="approvals:link_after_sign_in",
    inbox="approvals:inbox",
    inbox_label="approvals inbox",
    nothing_done="Nothing was decided.",
    recipient_noun="approver",
    state=_link_state,
    context=_link_context,
    decide=_link_decide,
    conflicts=(AlreadyDecided, ApprovalExpired),
)

approval_link = link_view(APPROVAL_LINK_PAGE)
approval_link_after_sign_in = after_sign_in_view(APPROVAL_LINK_PAGE)

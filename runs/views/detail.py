"""The run page (docs/console.md): status, lease, budgets, the timeline by incarnation, tool
calls, open waits, the state; and the operator's actions on the run.

Every action is a POST with CSRF that calls the same service the API calls
(``runs.services``), which checks the permission again and records the event naming the
operator. Views only parse, call, and render: a bad form shows its errors and changes
nothing; a refused action (wrong state, no permission) is a message, never a 500.

htmx: the summary polls itself while the run is not terminal and, when the run's event
sequence moved, sends ``HX-Trigger: run-changed`` so the timeline reloads (only then); the
actions panel reloads only when the set of actions on offer changed
(``run-actions-changed``), so a reason being typed is not wiped by a busy run. Without
JavaScript every form posts and redirects back here.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from django import forms
from django.contrib import messages
from django.contrib.auth.decorators import login_required, permission_required
from django.http import Http404, HttpRequest, HttpResponse
from django.shortcuts import redirect, render
from django.urls import reverse
from django.utils import timezone
from django.views.decorators.http import require_GET, require_POST
from django_htmx.middleware import HtmxDetails

from runs import jsonlimits, masking, selectors, services, timeline
from runs.actors import Actor
from runs.actors import PermissionDenied as ActorPermissionDenied
from runs.forms import UnclippedCharField
from runs.models import Run, ToolCall
from runs.record.checkpoint import RunNotFound
from runs.registry import UnknownAgent, registry

OPERATE = "runs.operate_run"


class HtmxHttpRequest(HttpRequest):
    htmx: HtmxDetails


# --- forms ---------------------------------------------------------------------------------


class PauseForm(forms.Form):
    reason = UnclippedCharField(required=False, max_length=2000)


class TerminateForm(forms.Form):
    reason = UnclippedCharField(
        max_length=2000,
        error_messages={"required": "Give a reason: it is recorded in the run's timeline."},
    )
    confirm = forms.BooleanField(
        error_messages={
            "required": "Tick the box to confirm: a terminated run can never be resumed."
        }
    )


class PromoteForm(forms.Form):
    confirm = forms.BooleanField(
        error_messages={"required": "Tick the box to confirm: the new run's tools act for real."}
    )


class BudgetForm(forms.Form):
    add_steps = forms.IntegerField(min_value=0, max_value=1_000_000, required=False)
    add_cost = forms.DecimalField(min_value=0, max_digits=12, decimal_places=6, required=False)
    add_tokens = forms.IntegerField(min_value=0, max_value=10**15, required=False)
    deadline = forms.DateTimeField(
        required=False,
        widget=forms.DateTimeInput(attrs={"type": "datetime-local"}),
        help_text="A new deadline, in your time zone (replaces the old one).",
    )

    def clean_deadline(self) -> Any:
        deadline = self.cleaned_data.get("deadline")
        if deadline is not None and deadline <= timezone.now():
            raise forms.ValidationError("The new deadline must be in the future.")
        return deadline

    def clean(self) -> dict[str, Any]:
        data = super().clean()
        if not self.errors and not any(
            data.get(name) for name in ("add_steps", "add_cost", "add_tokens", "deadline")
        ):
            raise forms.ValidationError(
                "Raise at least one limit: steps, cost, tokens or deadline."
            )
        return data


class ForkForm(forms.Form):
    from_step = forms.IntegerField(
        min_value=1,
        max_value=2**31 - 1,
        error_messages={"required": "Choose the last finished step the new run carries over."},
    )
    as_me = forms.BooleanField(required=False)


class EmptyForm(forms.Form):
    """Resume and retry recovery take nothing but the CSRF token."""


ACTION_FORMS: dict[str, type[forms.Form]] = {
    "pause": PauseForm,
    "resume": EmptyForm,
    "terminate": TerminateForm,
    "budget": BudgetForm,
    "retry_recovery": EmptyForm,
    "fork": ForkForm,
    "promote": PromoteForm,
}

START = "runs.start_run"


# --- the page ----------------------------------------------------------------------------


def _lease_live(run: Run) -> bool:
    # annotated in database time by the selector (the clock every lease decision uses)
    return bool(getattr(run, "lease_is_live", False))


def _budget_bars(run: Run) -> list[dict[str, Any]]:
    """Usage against each set limit, for <meter> bars (no inline styles)."""
    bars: list[dict[str, Any]] = [
        {"label": "Steps", "used": run.steps_used, "limit": run.max_steps}
    ]
    bars.append({"label": "Cost", "used": run.cost_used, "limit": run.max_cost})
    bars.append({"label": "Tokens", "used": run.tokens_used, "limit": run.max_tokens})
    return bars


def _available(run: Run) -> dict[str, bool]:
    """Which actions make sense now (the service decides in the end: a stale page still
    gets a clear refusal)."""
    status = run.status
    attention = status == Run.Status.NEEDS_ATTENTION
    return {
        "pause": status in (Run.Status.QUEUED, Run.Status.RUNNING),
        "resume": status == Run.Status.PAUSED,
        "terminate": status not in Run.TERMINAL,
        "budget": status not in Run.TERMINAL
        and (not attention or run.reason_code == Run.Reason.BUDGET_EXHAUSTED),
        "retry_recovery": attention and run.reason_code in services.RETRYABLE,
        # a run being driven is refused by the service with a clear message; offering the
        # form regardless keeps the panel the same while a run flips between queued and
        # running every slice (the panel reloads only when this set changes)
        "fork": True,
        # a finished dry run, not promoted yet (issue 23)
        "promote": run.dry_run and status in Run.TERMINAL and promoted_to(run) is None,
    }


def promoted_to(run: Run) -> Run | None:
    """The real run a dry run was promoted to (selected with the run: no query)."""
    if not run.dry_run:
        return None
    try:
        return run.promoted_to
    except Run.DoesNotExist:
        return None


# What a person does about each reason a run stopped for them (docs/recovery.md).
NEXT_STEP = {
    Run.Reason.UNKNOWN_OUTCOME: "Check the external system, then resolve the call in the "
    "unknown-outcomes inbox.",
    Run.Reason.BUDGET_EXHAUSTED: "Top up the budget to let it go on, or terminate it.",
    Run.Reason.RECOVERY_LIMIT: "It kept crashing: read the incarnations below, then retry "
    "recovery, fork it, or terminate it.",
    Run.Reason.INCOMPATIBLE_AGENT_VERSION: "No state migration reaches the registered "
    "version: deploy one and retry, fork it onto that version from a completed step, or "
    "terminate it.",
    Run.Reason.MODEL_UNAVAILABLE: "The model it is pinned to is gone: retry to move it to the "
    "configured model (recorded), fork it, or terminate it.",
    Run.Reason.PRECONDITION_FAILED: "A tool's precondition raised: fix what it checks (or "
    "deploy a fixed tool) and retry, fork it from an earlier step, or terminate it.",
    Run.Reason.TOOL_RETIRED: "A call was in flight when its tool changed or was retired, so "
    "its outcome is unknown: check the external system, then resolve the call in the "
    "unknown-outcomes inbox (or fork the run from an earlier step, or terminate it).",
    Run.Reason.PRINCIPAL_REVOKED: "Its principal may no longer use a tool: restore their "
    "access, then resume it.",
}


def _next_step(run: Run) -> str:
    if run.status not in (Run.Status.NEEDS_ATTENTION, Run.Status.PAUSED):
        return ""
    return NEXT_STEP.get(run.reason_code, "")


def _registered_version(run: Run) -> str:
    """The version a fork would run on ("" when the agent is no longer registered)."""
    try:
        return registry.agent(run.agent_name).version
    except UnknownAgent:
        return ""


def _actions_signature(run: Run) -> str:
    return ",".join(name for name, ok in _available(run).items() if ok)


def _context(
    request: HtmxHttpRequest,
    detail: selectors.RunDetail,
    *,
    action: str = "",
    form: forms.Form | None = None,
    error: str = "",
    flash: str = "",
) -> dict[str, Any]:
    run = detail.run
    forms_by_action = {name: cls() for name, cls in ACTION_FORMS.items()}
    if action and form is not None:
        forms_by_action[action] = form
    lease_live = _lease_live(run)
    mask = masking.masker_for(run, user=request.user)
    groups = timeline.build(
        detail.events,
        steps=detail.steps,
        lease=timeline.LeaseNow(owner=run.lease_owner, fence=run.fence, live=lease_live),
        continued=detail.has_older,
        mask=mask,
    )
    unknown_calls = [c for c in detail.calls if c.status == ToolCall.Status.UNKNOWN]
    awaiting = [
        (call, detail.approvals.get(call.step.seq))
        for call in detail.calls
        if call.status == ToolCall.Status.AWAITING_APPROVAL
    ]
    return {
        "run": run,
        "detail": detail,
        "groups": groups,
        "oldest_seq": detail.events[0].seq if detail.events else None,
        "has_older": detail.has_older,
        "lease_live": lease_live,
        "bars": _budget_bars(run),
        "next_step": _next_step(run),
        "available": _available(run),
        "fork_version": _registered_version(run),
        "acts": _actions_signature(run),
        "may_operate": request.user.has_perm(OPERATE),
        "may_start": request.user.has_perm(START),
        "may_resolve": request.user.has_perm("runs.resolve_toolcall"),
        "forms": forms_by_action,
        "action": action,
        "error": error,
        "flash": flash,
        "unknown_calls": unknown_calls,
        "awaiting": awaiting,
        # the template masks the rest (calls, receipts, waits) with the ``masked`` filters
        "mask": mask,
        "state_json": jsonlimits.pretty(mask(run.state)),
        "result_json": jsonlimits.pretty(mask(run.result)) if run.result is not None else "",
    }


def _detail_or_404(run_id: Any) -> selectors.RunDetail:
    try:
        return selectors.run_detail(run_id=run_id)
    except Run.DoesNotExist:
        raise Http404("no such run") from None


@login_required
@permission_required("runs.view_run", raise_exception=True)
@require_GET
def run_detail(request: HtmxHttpRequest, run_id: Any) -> HttpResponse:
    part = request.GET.get("part", "") if request.htmx else ""
    if part == "summary":
        return _summary(request, run_id)
    detail = _detail_or_404(run_id)
    context = _context(request, detail)
    template = "runs/detail.html"
    if part in ("timeline", "actions"):
        template += f"#run-{part}"
    return render(request, template, context)


def _summary(request: HtmxHttpRequest, run_id: Any) -> HttpResponse:
    """The polled header: one query. It tells the page what else to reload."""
    try:
        run = selectors.run_with_lease(run_id=run_id)
    except Run.DoesNotExist:
        raise Http404("no such run") from None
    context = {
        "run": run,
        "lease_live": _lease_live(run),
        "bars": _budget_bars(run),
        "next_step": _next_step(run),
        "acts": _actions_signature(run),
        "may_operate": request.user.has_perm(OPERATE),
    }
    response = render(request, "runs/detail.html#run-summary", context)
    triggers = []
    if request.GET.get("seen") != str(run.event_seq):
        triggers.append("run-changed")
    if request.GET.get("acts") != context["acts"]:
        triggers.append("run-actions-changed")
    if triggers:
        response["HX-Trigger"] = ", ".join(triggers)
    return response


@login_required
@permission_required("runs.view_run", raise_exception=True)
@require_GET
def run_events(request: HtmxHttpRequest, run_id: Any) -> HttpResponse:
    """An older page of the timeline ("load older"), in the same groups."""
    try:
        before = int(request.GET.get("before", ""))
    except ValueError:
        before = 0
    if not 1 <= before <= 2**63 - 1:
        return HttpResponse("before must be an event number", status=400)
    run = Run.objects.filter(id=run_id).only("id", "agent_name").first()
    if run is None:
        raise Http404("no such run")
    events, has_older = selectors.run_events_page(run_id=run_id, before=before)
    steps = selectors.steps_by_seq(run_id=run_id, seqs=timeline.step_seqs(events))
    mask = masking.masker_for(run, user=request.user)
    context = {
        "run_id": run_id,
        "mask": mask,
        "groups": timeline.build(
            events, steps=steps, continued=has_older, continues=True, mask=mask
        ),
        "has_older": has_older,
        "oldest_seq": events[0].seq if events else None,
    }
    template = "runs/_timeline_page.html" if request.htmx else "runs/events.html"
    return render(request, template, context)


# --- actions --------------------------------------------------------------------------------


def _refused(request: HtmxHttpRequest, run_id: Any, what: str, perm: str) -> HttpResponse:
    context = {"run_id": run_id, "what": what, "perm": perm}
    template = "runs/_refused.html#refusal" if request.htmx else "runs/_refused.html"
    return render(request, template, context, status=403)


def _act(
    request: HtmxHttpRequest,
    run_id: Any,
    action: str,
    what: str,
    do: Callable[[Actor, dict[str, Any]], Run],
    done: Callable[[Run], str],
    perm: str = OPERATE,
) -> HttpResponse:
    if not request.user.has_perm(perm):
        return _refused(request, run_id, what, perm)
    form = ACTION_FORMS[action](request.POST)
    if not form.is_valid():
        return _after_error(request, run_id, action=action, form=form, status=400)
    actor = Actor.for_user(request.user, "web")
    try:
        # The service owns a savepoint inside an outer transaction (a test case,
        # ATOMIC_REQUESTS): a refused action does not break it, so the page can still be
        # read afterwards to show the refusal.
        run = do(actor, form.cleaned_data)
    except (Run.DoesNotExist, RunNotFound):
        raise Http404("no such run") from None
    except ActorPermissionDenied:
        return _refused(request, run_id, what, perm)
    except services.InvalidInput as exc:
        return _after_error(request, run_id, action=action, form=form, error=str(exc), status=400)
    except services.InvalidState as exc:
        return _after_error(request, run_id, action=action, form=form, error=str(exc), status=409)
    message = done(run)
    if run.id != _uuid(run_id):
        # a fork or a promotion: the operator continues on the new run's page
        messages.success(request, message)
        url = reverse("runs:detail", args=[run.id])
        if request.htmx:
            response = HttpResponse(status=204)
            response["HX-Redirect"] = url
            return response
        return redirect(url)
    if request.htmx:
        # the fresh actions panel, plus the message and the summary out of band: the summary
        # then polls from the new state and does not reload the panel for this action
        detail = _detail_or_404(run_id)
        context = _context(request, detail, flash=message)
        context["refresh_summary"] = True
        response = render(request, "runs/detail.html#run-actions", context)
        # runs-changed: the console's counters (runs.views.console) refresh too
        response["HX-Trigger"] = "run-changed, runs-changed"
        return response
    messages.success(request, message)
    return redirect("runs:detail", run_id=run_id)


def _uuid(value: Any) -> Any:
    import uuid

    return value if isinstance(value, uuid.UUID) else uuid.UUID(str(value))


def _after_error(
    request: HtmxHttpRequest,
    run_id: Any,
    *,
    action: str,
    form: forms.Form,
    error: str = "",
    status: int,
) -> HttpResponse:
    """The form's errors or the service's refusal, on the page, with nothing changed: the
    actions panel for htmx (base.html tells htmx to swap 4xx answers in), else the page."""
    detail = _detail_or_404(run_id)
    context = _context(request, detail, action=action, form=form, error=error)
    if not error and form.errors and not _form_on_page(context, action):
        # the action's form is not on the page now (the run moved on, or a request made by
        # hand), so its field errors would not be seen: they are the page's error instead
        context["error"] = " ".join(str(e) for errors in form.errors.values() for e in errors)
    template = "runs/detail.html#run-actions" if request.htmx else "runs/detail.html"
    return render(request, template, context, status=status)


def _form_on_page(context: dict[str, Any], action: str) -> bool:
    """Whether runs/detail.html shows the action's form (the template's own conditions)."""
    if action == "fork":
        return bool(context["detail"].fork_steps and context["fork_version"])
    return context["available"].get(action, False)


@login_required
@require_POST
def run_pause_view(request: HtmxHttpRequest, run_id: Any) -> HttpResponse:
    def done(run: Run) -> str:
        if run.status == Run.Status.PAUSED:
            return "The run is paused."
        return "Pause requested: the worker pauses the run at its next checkpoint."

    return _act(
        request,
        run_id,
        "pause",
        "pause this run",
        lambda actor, data: services.run_pause(run_id=run_id, actor=actor, reason=data["reason"]),
        done,
    )


@login_required
@require_POST
def run_resume_view(request: HtmxHttpRequest, run_id: Any) -> HttpResponse:
    return _act(
        request,
        run_id,
        "resume",
        "resume this run",
        lambda actor, data: services.run_resume(run_id=run_id, actor=actor),
        lambda run: "The run is resumed and queued for a worker.",
    )


@login_required
@require_POST
def run_terminate_view(request: HtmxHttpRequest, run_id: Any) -> HttpResponse:
    def done(run: Run) -> str:
        if run.status == Run.Status.TERMINATED:
            return "The run is terminated."
        return "Termination requested: the worker stops the run at its next checkpoint."

    return _act(
        request,
        run_id,
        "terminate",
        "terminate this run",
        lambda actor, data: services.run_terminate(
            run_id=run_id, actor=actor, reason=data["reason"].strip()
        ),
        done,
    )


@login_required
@require_POST
def run_budget_view(request: HtmxHttpRequest, run_id: Any) -> HttpResponse:
    def topup(actor: Actor, data: dict[str, Any]) -> Run:
        return services.run_topup_budget(
            run_id=run_id,
            actor=actor,
            add_steps=data["add_steps"] or 0,
            add_cost=data["add_cost"],
            add_tokens=data["add_tokens"] or 0,
            deadline=data["deadline"],
        )

    # only for the message: the service decides under its lock whether the run goes on
    was_stopped = Run.objects.filter(
        id=run_id, status=Run.Status.NEEDS_ATTENTION, reason_code=Run.Reason.BUDGET_EXHAUSTED
    ).exists()

    def done(run: Run) -> str:
        if was_stopped and run.status == Run.Status.QUEUED:
            return "Budget topped up; the run is queued again."
        return "Budget topped up."

    return _act(request, run_id, "budget", "top up this run's budget", topup, done)


@login_required
@require_POST
def run_retry_recovery_view(request: HtmxHttpRequest, run_id: Any) -> HttpResponse:
    return _act(
        request,
        run_id,
        "retry_recovery",
        "retry this run's recovery",
        lambda actor, data: services.run_retry_recovery(run_id=run_id, actor=actor),
        lambda run: "Recovery retried; the run is queued again.",
    )


@login_required
@require_POST
def run_fork_view(request: HtmxHttpRequest, run_id: Any) -> HttpResponse:
    return _act(
        request,
        run_id,
        "fork",
        "fork this run",
        lambda actor, data: services.run_fork(
            run_id=run_id, actor=actor, from_step=data["from_step"], as_me=data["as_me"]
        ),
        lambda fork: (
            f"Forked from step #{fork.forked_from_step} onto {fork.agent_name} "
            f"v{fork.agent_version}; the old run is terminated."
        ),
    )


@login_required
@require_POST
def run_promote_view(request: HtmxHttpRequest, run_id: Any) -> HttpResponse:
    return _act(
        request,
        run_id,
        "promote",
        "promote this dry run",
        lambda actor, data: services.run_promote(run_id=run_id, actor=actor),
        lambda run: (
            f"Promoted: run {str(run.id)[:8]} starts {run.agent_name} for real with the dry "
            "run's input; it decides afresh and its approvals are asked again."
        ),
        perm=START,
    )

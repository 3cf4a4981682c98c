"""Runs and steps: the run page (its timeline and calls), and the actions that call the
services (terminate, retry recovery, pause, resume)."""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable
from typing import Any

from django import forms
from django.contrib import admin, messages
from django.contrib.admin import helpers
from django.http import HttpRequest
from django.template.response import TemplateResponse
from django.urls import reverse

from runs.actors import Actor, PermissionDenied
from runs.admin.base import ReadOnlyAdmin, as_uuid, run_link
from runs.admin.filters import AgentFilter
from runs.masking import UNMASKED, Masker, maskers_for_ids
from runs.models import Run, RunEvent, Step, ToolCall
from runs.services import (
    InvalidInput,
    InvalidState,
    run_pause,
    run_resume,
    run_retry_recovery,
    run_terminate,
)


class TerminateForm(forms.Form):
    reason = forms.CharField(
        max_length=1000,
        widget=forms.Textarea(attrs={"rows": 3, "cols": 60}),
        help_text="Recorded in each run's terminate event, with your name.",
    )

    def clean_reason(self) -> str:
        reason = self.cleaned_data["reason"].strip()
        if not reason:
            raise forms.ValidationError("a reason is required to terminate a run")
        return reason


MAX_MESSAGES = 10


def _report(modeladmin, request, done: int, verb: str, failures: list[str]) -> None:
    if done:
        modeladmin.message_user(request, f"{done} run(s) {verb}.", messages.SUCCESS)
    for failure in failures[:MAX_MESSAGES]:
        modeladmin.message_user(request, failure, messages.WARNING)
    if len(failures) > MAX_MESSAGES:
        modeladmin.message_user(
            request, f"… and {len(failures) - MAX_MESSAGES} more not changed.", messages.WARNING
        )


@admin.action(description="Terminate selected runs (asks for a reason)", permissions=["operate"])
def terminate_runs(modeladmin, request, queryset):
    """An intermediate page asks for the reason; only its POST terminates."""
    form = TerminateForm(request.POST if "apply" in request.POST else None)
    if "apply" in request.POST and form.is_valid():
        actor = Actor.for_user(request.user, "admin")
        terminated = requested = 0
        failures: list[str] = []
        for run_id in _ids_in_chunks(queryset):
            try:
                # the service owns its savepoint: a refusal rolls back that run only, and
                # leaves any enclosing transaction usable for the next one
                run = run_terminate(run_id=run_id, actor=actor, reason=form.cleaned_data["reason"])
            except (InvalidState, InvalidInput, PermissionDenied) as exc:
                failures.append(f"{run_id}: {exc}")
                continue
            if run.status == Run.Status.TERMINATED:
                terminated += 1
            else:
                requested += 1
        _report(modeladmin, request, terminated, "terminated", failures)
        if requested:
            modeladmin.message_user(
                request,
                f"{requested} running run(s) asked to terminate at their next checkpoint.",
                messages.SUCCESS,
            )
        return None  # back to the changelist
    count = queryset.count()
    return TemplateResponse(
        request,
        "admin/runs/run/terminate_confirmation.html",
        {
            **modeladmin.admin_site.each_context(request),
            "title": "Terminate runs",
            "opts": modeladmin.opts,
            "form": form,
            "runs": queryset.select_related(None).only("id", "agent_name", "status")[:100],
            "count": count,
            "selected": request.POST.getlist(helpers.ACTION_CHECKBOX_NAME),
            "select_across": request.POST.get("select_across", "0"),
            "action_checkbox_name": helpers.ACTION_CHECKBOX_NAME,
        },
    )


def _ids_in_chunks(queryset, size: int = 500):
    """The selected runs' ids, a chunk at a time, with no cursor left open between chunks:
    a service may enqueue work, and django-q's ORM broker closes the connection (on SQLite
    an open server-side ``iterator()`` then failed after the first run)."""
    ids = queryset.order_by("pk").values_list("pk", flat=True)
    last = None
    while True:
        chunk = list((ids if last is None else ids.filter(pk__gt=last))[:size])
        yield from chunk
        if len(chunk) < size:
            return
        last = chunk[-1]


def _each_run(
    modeladmin, request, queryset, service: Callable[..., Run], verb: str, **kwargs: Any
) -> None:
    actor = Actor.for_user(request.user, "admin")
    done = 0
    failures: list[str] = []
    for run_id in _ids_in_chunks(queryset):
        try:
            service(run_id=run_id, actor=actor, **kwargs)  # its own savepoint: see terminate_runs
        except (InvalidState, InvalidInput, PermissionDenied) as exc:
            failures.append(f"{run_id}: {exc}")
            continue
        done += 1
    _report(modeladmin, request, done, verb, failures)


@admin.action(
    description="Retry recovery of selected runs (recovery limit)", permissions=["operate"]
)
def retry_recovery(modeladmin, request, queryset):
    _each_run(modeladmin, request, queryset, run_retry_recovery, "queued again")


@admin.action(description="Pause selected runs", permissions=["operate"])
def pause_runs(modeladmin, request, queryset):
    _each_run(modeladmin, request, queryset, run_pause, "paused or asked to pause", reason="admin")


@admin.action(description="Resume selected paused runs", permissions=["operate"])
def resume_runs(modeladmin, request, queryset):
    _each_run(modeladmin, request, queryset, run_resume, "resumed")


TIMELINE_PAGE = 100
TOOL_CALLS_SHOWN = 100


@admin.register(Run)
class RunAdmin(ReadOnlyAdmin):
    list_display = [
        "id",
        "agent_name",
        "agent_version",
        "status",
        "reason_code",
        "principal",
        "steps_used",
        "recovery_count",
        "dry_run",
        "created_at",
        "finished_at",
    ]
    list_select_related = ["principal"]
    list_filter = ["status", "reason_code", "dry_run", AgentFilter]
    uuid_search_fields = ("id", "root_run_id", "forked_from_id")
    exact_search_fields = (
        "tool_calls__idempotency_key",
        "tool_calls__receipt__external_ref",
        "principal__username",
        "trace_id",
    )
    date_hierarchy = "created_at"
    actions = [terminate_runs, retry_recovery, pause_runs, resume_runs]
    change_form_template = "admin/runs/run/change_form.html"
    fieldsets = [
        (
            None,
            {
                "fields": [
                    "id",
                    ("agent_name", "agent_version", "model_id"),
                    "goal",
                    ("status", "reason_code"),
                    "reason_detail",
                    "principal",
                    ("created_at", "updated_at", "finished_at"),
                ]
            },
        ),
        ("Input, state and result", {"fields": ["input", "state", "state_version", "result"]}),
        (
            "Budget",
            {
                "fields": [
                    ("max_steps", "steps_used"),
                    ("max_cost", "cost_used"),
                    ("max_tokens", "tokens_used"),
                    "deadline",
                ]
            },
        ),
        (
            "Lease and recovery",
            {
                "fields": [
                    ("lease_owner", "lease_expires_at", "fence"),
                    ("recovery_count", "recovery_count_at_retry"),
                    ("wake_at", "enqueued_at"),
                    ("requested_action", "requested_by", "requested_reason"),
                ]
            },
        ),
        (
            "Lineage and audit chain",
            {
                "fields": [
                    "trace_id",
                    ("root_run", "forked_from", "forked_from_step"),
                    # a dry run's tools were only simulated; a promoted run started from one
                    ("dry_run", "promoted_from"),
                    ("event_seq", "last_event_hash"),
                ]
            },
        ),
    ]

    def has_operate_permission(self, request: HttpRequest) -> bool:
        return request.user.has_perm("runs.operate_run")

    def get_actions(self, request):
        actions = super().get_actions(request)
        actions.pop("delete_selected", None)
        return actions

    masked_fields = ("input", "state", "result", "reason_detail")

    def masked_run_id(self, obj: Run) -> Any:
        return obj.id

    def change_view(self, request, object_id, form_url="", extra_context=None):
        extra_context = dict(extra_context or {})
        run_id = as_uuid(str(object_id))
        if run_id is not None:
            extra_context.update(self._timeline_context(request, run_id))
        return super().change_view(request, object_id, form_url, extra_context)

    def _timeline_context(self, request: HttpRequest, run_id: uuid.UUID) -> dict[str, Any]:
        """One page of the run's events by ``seq`` range (the run knows its event count, so no
        COUNT query), and its tool calls with their receipts: a fixed number of queries."""
        total = Run.objects.filter(id=run_id).values_list("event_seq", flat=True).first()
        if total is None:
            return {}
        pages = max(1, -(-total // TIMELINE_PAGE))
        try:
            page = int(request.GET.get("timeline", pages))
        except ValueError:
            page = pages
        page = min(max(page, 1), pages)
        first = (page - 1) * TIMELINE_PAGE
        events = list(
            RunEvent.objects.filter(
                run_id=run_id, seq__gt=first, seq__lte=first + TIMELINE_PAGE
            ).order_by("seq")
        )
        mask = maskers_for_ids([run_id], user=request.user).get(run_id, UNMASKED)
        for event in events:
            # as JSON, the way the API and the exports show it (not a Python repr)
            event.payload_json = json.dumps(mask(event.payload), sort_keys=True, default=str)
        calls = list(
            ToolCall.objects.filter(run_id=run_id)
            .select_related("step", "receipt")
            .order_by("step__seq")[: TOOL_CALLS_SHOWN + 1]
        )
        return {
            "timeline": events,
            "timeline_total": total,
            "timeline_first_seq": events[0].seq if events else 0,
            "timeline_last_seq": events[-1].seq if events else 0,
            "timeline_page": page,
            "timeline_pages": pages,
            "timeline_previous": page - 1 if page > 1 else None,
            "timeline_next": page + 1 if page < pages else None,
            "tool_calls": calls[:TOOL_CALLS_SHOWN],
            "tool_calls_more": len(calls) > TOOL_CALLS_SHOWN,
            "events_url": reverse("admin:runs_runevent_changelist") + f"?run_id__exact={run_id}",
            "tool_calls_url": reverse("admin:runs_toolcall_changelist")
            + f"?run_id__exact={run_id}",
        }


@admin.register(Step)
class StepAdmin(ReadOnlyAdmin):
    list_display = [
        "id",
        "run_column",
        "seq",
        "kind",
        "status",
        "incarnation",
        "cost",
        "created_at",
    ]
    list_filter = ["kind", "status"]
    uuid_search_fields = ("run_id",)
    date_hierarchy = "created_at"

    masked_fields = ("input", "output", "error")

    def mask_object(self, obj: Step, mask: Masker) -> None:
        tool = (obj.input or {}).get("tool") if isinstance(obj.input, dict) else None
        obj.output = mask.output(tool, obj.output) if tool else mask(obj.output)
        obj.input = mask(obj.input)
        obj.error = mask(obj.error)

    @admin.display(description="run", ordering="run_id")
    def run_column(self, obj: Step) -> str:
        return run_link(obj.run_id)

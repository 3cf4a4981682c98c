"""The tool limits page (docs/agents.md "Limits", docs/console.md): every limited tool with
what it holds now — calls in flight, runs waiting for capacity — and, for operators, a form
to set or remove a limit at run time. Both call the services the API calls (``runs.flow``)."""

from __future__ import annotations

from django import forms
from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.core.exceptions import PermissionDenied
from django.http import HttpResponse
from django.shortcuts import redirect, render
from django.views.decorators.http import require_http_methods

from runs import flow
from runs.actors import Actor
from runs.actors import PermissionDenied as ActorPermissionDenied


class ToolLimitForm(forms.Form):
    tool_name = forms.CharField(max_length=200)
    max_in_flight = forms.IntegerField(min_value=1, max_value=100_000, required=False)
    rate = forms.FloatField(min_value=0.001, max_value=1_000_000, required=False)
    per_seconds = forms.TypedChoiceField(
        choices=[("1", "per second"), ("60", "per minute")], coerce=float, initial="1"
    )
    burst = forms.IntegerField(min_value=1, max_value=100_000, required=False)
    key_argument = forms.CharField(max_length=100, required=False)
    reason = forms.CharField(max_length=2000, required=False)


@login_required
@require_http_methods(["GET", "POST"])
def tool_limits(request) -> HttpResponse:
    if not request.user.has_perm("runs.view_run"):
        raise PermissionDenied
    form = ToolLimitForm(request.POST or None)
    status = 200
    if request.method == "POST":
        actor = Actor.for_user(request.user, "web")
        try:
            if request.POST.get("action") == "remove":
                name = request.POST.get("tool_name", "")
                if flow.tool_limit_remove(
                    tool_name=name, actor=actor, reason=request.POST.get("reason", "")
                ):
                    messages.success(request, f"The operator's limit on {name} was removed.")
                else:
                    messages.error(request, f"{name} has no operator's limit.")
                return redirect("runs:limits")
            if form.is_valid():
                try:
                    row = flow.tool_limit_set(actor=actor, request=request, **form.cleaned_data)
                except flow.InvalidLimit as exc:
                    for field, errors in (exc.fields or {"__all__": [str(exc)]}).items():
                        form.add_error(None if field == "non_field_errors" else field, errors)
                else:
                    messages.success(request, f"Limit on {row.tool_name} set.")
                    return redirect("runs:limits")
            status = 400
        except ActorPermissionDenied as exc:
            raise PermissionDenied(str(exc)) from exc
    return render(
        request,
        "runs/limits.html",
        {
            "views": flow.limit_views(),
            "form": form,
            "can_operate": request.user.has_perm("runs.operate_run"),
        },
        status=status,
    )

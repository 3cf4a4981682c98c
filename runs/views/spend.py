"""The spend caps page (docs/agents.md "Spend caps", docs/console.md): every cap with what
its scope used, reserved and has left in the current period, the runs it stopped and the
model requests a crash cut off; for operators, forms to set or remove a cap, top a scope up
and settle a cut-off request. They call the services the API calls (``runs.spend``)."""

from __future__ import annotations

from django import forms
from django.conf import settings
from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.core.exceptions import PermissionDenied
from django.http import HttpResponse
from django.shortcuts import redirect, render
from django.views.decorators.http import require_http_methods

from runs import spend
from runs.actors import Actor
from runs.actors import PermissionDenied as ActorPermissionDenied
from runs.errors import InvalidInput, InvalidState, NotFound
from runs.models import SpendCap

# what a service refuses as the input's fault (a form error); a permission is a 403
_REFUSED = (InvalidInput, InvalidState, NotFound)
_MONEY = {"max_digits": 12, "decimal_places": 6, "min_value": 0, "max_value": 999_999}


class SpendCapForm(forms.Form):
    scope = forms.ChoiceField(choices=SpendCap.Scope.choices)
    subject = forms.CharField(
        max_length=200,
        required=False,
        help_text="The agent's name, the principal's username (or * for each principal); "
        "nothing for everything per day.",
    )
    max_cost = forms.DecimalField(required=False, **_MONEY)
    max_tokens = forms.IntegerField(min_value=0, max_value=2**62, required=False)
    reason = forms.CharField(max_length=2000, required=False)


class RemoveForm(forms.Form):
    scope = forms.ChoiceField(choices=SpendCap.Scope.choices)
    subject = forms.CharField(max_length=200, required=False)
    reason = forms.CharField(max_length=2000, required=False)


class TopUpForm(forms.Form):
    scope = forms.ChoiceField(choices=SpendCap.Scope.choices)
    subject = forms.CharField(max_length=200, required=False)
    add_cost = forms.DecimalField(required=False, **_MONEY)
    add_tokens = forms.IntegerField(min_value=0, max_value=2**62, required=False)
    reason = forms.CharField(max_length=2000, required=False)


class SettleForm(forms.Form):
    reservation = forms.IntegerField(min_value=1)
    cost = forms.DecimalField(**_MONEY)
    tokens = forms.IntegerField(min_value=0, max_value=2**62)


def _form_errors(form: forms.Form, exc: Exception) -> None:
    for field, errors in (getattr(exc, "fields", None) or {"__all__": [str(exc)]}).items():
        form.add_error(field if field in form.fields else None, errors)


@login_required
@require_http_methods(["GET", "POST"])
def spend_caps(request) -> HttpResponse:
    if not request.user.has_perm("runs.view_run"):
        raise PermissionDenied
    action = request.POST.get("action", "set")
    posted = request.POST if request.method == "POST" else None
    # the main form also carries what is wrong with a removal or an unknown action
    form = SpendCapForm(posted if action not in ("top_up", "settle") else None)
    top_up = TopUpForm(posted if action == "top_up" else None)
    settle = SettleForm(posted if action == "settle" else None)
    status = 200
    if request.method == "POST":
        actor = Actor.for_user(request.user, "web")
        try:
            done = _post(request, actor, action, form, top_up, settle)
        except ActorPermissionDenied as exc:
            raise PermissionDenied(str(exc)) from exc
        if done:
            return redirect("runs:spend")
        status = 400
    return render(
        request,
        "runs/spend.html",
        {
            "views": spend.scope_views(),
            "cut_off": spend.cut_off_reservations(),
            "form": form,
            "top_up": top_up,
            "settle": settle,
            "can_operate": request.user.has_perm("runs.operate_run"),
            "time_zone": settings.AGENTOPS["SPEND_TIME_ZONE"],
            "today": spend.today(),
        },
        status=status,
    )


def _post(request, actor, action, form, top_up, settle) -> bool:
    """Apply the posted action; True when it was applied (the page redirects)."""
    if action == "remove":
        removal = RemoveForm(request.POST)
        if not removal.is_valid():
            # shown with the page's main form (the remove buttons carry no visible fields)
            for errors in removal.errors.values():
                form.add_error(None, errors)
            return False
        try:
            removed = spend.spend_cap_remove(actor=actor, request=request, **removal.cleaned_data)
        except _REFUSED as exc:
            messages.error(request, str(exc))
            return True
        if removed:
            messages.success(request, "The cap was removed; the runs it stopped were resumed.")
        else:
            messages.error(request, "There is no such cap.")
        return True
    if action == "top_up":
        if not top_up.is_valid():
            return False
        try:
            done = spend.spend_top_up(actor=actor, request=request, **top_up.cleaned_data)
        except _REFUSED as exc:
            _form_errors(top_up, exc)
            return False
        messages.success(
            request,
            f"{spend.describe(done.counter)} topped up; {done.resumed} run(s) resumed.",
        )
        return True
    if action == "settle":
        if not settle.is_valid():
            return False
        data = settle.cleaned_data
        try:
            spend.spend_reservation_settle(
                reservation_id=data["reservation"],
                cost=data["cost"],
                tokens=data["tokens"],
                actor=actor,
                request=request,
            )
        except _REFUSED as exc:
            _form_errors(settle, exc)
            return False
        messages.success(request, f"Reservation {data['reservation']} settled.")
        return True
    if action != "set":
        form.add_error(None, f"unknown action {action[:50]!r}")
        return False
    if not form.is_valid():
        return False
    try:
        row = spend.spend_cap_set(actor=actor, request=request, **form.cleaned_data)
    except _REFUSED as exc:
        _form_errors(form, exc)
        return False
    messages.success(
        request, f"Cap on {row.get_scope_display()} {form.cleaned_data['subject']} set."
    )
    return True

"""The unknown-outcomes inbox (docs/console.md): every tool call whose outcome is unknown,
oldest first, with its request, key, attempts and every lookup; and the operator's four
resolutions, each through ``runs.services.toolcall_resolve`` (the API's service too).

An ``unsafe`` tool cannot be looked up and may repeat its effect when sent again: the page
says so, and dispatching it again needs an explicit confirmation that is recorded.
"""

from __future__ import annotations

from typing import Any

from django import forms
from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.http import Http404, HttpRequest, HttpResponse
from django.shortcuts import redirect, render
from django.views.decorators.http import require_GET, require_http_methods, require_POST
from django_htmx.middleware import HtmxDetails

from runs import jsonlimits, selectors, services, timeline
from runs.actors import Actor
from runs.actors import PermissionDenied as ActorPermissionDenied
from runs.forms import UnclippedCharField
from runs.masking import Masker, maskers_for
from runs.models import Run, RunEvent, ToolCall
from runs.registry import Effect, Tool, UnknownTool, registry
from runs.services import Resolution

RESOLVE = "runs.resolve_toolcall"
RESULT_MAX_CHARS = 100_000
BIGINT_MAX = 2**63 - 1


class HtmxHttpRequest(HttpRequest):
    htmx: HtmxDetails


class ResolveForm(forms.Form):
    outcome = forms.ChoiceField(
        choices=[
            (Resolution.RECONCILE, "Reconcile again"),
            (Resolution.HAPPENED, "It happened"),
            (Resolution.NOT_HAPPENED, "It did not happen"),
            (Resolution.DISPATCH_AGAIN, "Dispatch again with the same key"),
        ]
    )
    external_ref = UnclippedCharField(required=False, max_length=200)
    result = UnclippedCharField(required=False, max_length=RESULT_MAX_CHARS, widget=forms.Textarea)
    confirm_risk = forms.BooleanField(required=False)
    attestation = UnclippedCharField(
        required=False, max_length=services.ATTESTATION_MAX, widget=forms.Textarea
    )

    def __init__(self, *args: Any, call: ToolCall, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.call = call

    def clean_result(self) -> Any:
        text = self.cleaned_data.get("result", "").strip()
        if not text:
            return None
        try:
            # PostgreSQL cannot store U+0000 in jsonb: bad input, not a failed insert
            value = jsonlimits.loads(text)
        except jsonlimits.JsonRejected as exc:
            raise forms.ValidationError(f"{exc.detail}.", code=exc.code) from None
        except ValueError as exc:
            raise forms.ValidationError(f"Not valid JSON: {exc}") from None
        return value

    def clean(self) -> dict[str, Any]:
        data = super().clean()
        outcome = data.get("outcome")
        if (
            outcome == Resolution.HAPPENED
            and "result" not in self.errors
            and not (data.get("external_ref", "").strip() or data.get("result") is not None)
        ):
            self.add_error(
                "external_ref",
                "Give the external system's reference and/or the result, so the record "
                "says how you know it happened.",
            )
        if (
            outcome == Resolution.DISPATCH_AGAIN
            and self.call.effect == Effect.UNSAFE
            and not data.get("confirm_risk")
        ):
            self.add_error(
                "confirm_risk",
                f"{self.call.tool_name} is unsafe: sending it again may repeat its effect. "
                "Tick the box to confirm you accept that risk.",
            )
        return data


def _may_view(user: Any) -> bool:
    return user.has_perm("runs.view_toolcall") or user.has_perm(RESOLVE)


class _Tools:
    """Registry lookups for the page, once per tool name (a remote tool costs a query)."""

    def __init__(self) -> None:
        self._cache: dict[str, Tool | None] = {}

    def get(self, name: str) -> Tool | None:
        if name not in self._cache:
            try:
                self._cache[name] = registry.tool(name)
            except UnknownTool:
                self._cache[name] = None
        return self._cache[name]


def _row(
    call: ToolCall,
    history: list[timeline.Entry],
    tools: _Tools,
    mask: Masker,
    *,
    latest_lookup: dict | None,
    form: ResolveForm | None = None,
    error: str = "",
) -> dict[str, Any]:
    """What one call's card shows and which resolutions it offers."""
    tool = tools.get(call.tool_name)
    current = tool is not None and tool.accepts(call.tool_version)
    waiting = call.run.status == Run.Status.NEEDS_ATTENTION
    return {
        "call": call,
        "run": call.run,
        "history": history,
        "shown_arguments": mask(call.arguments_masked),
        "arguments_json": jsonlimits.pretty(mask(call.arguments_masked)),
        "last_error": mask(call.last_error),
        "unsafe": call.effect == Effect.UNSAFE,
        "retired": not current,
        "waiting": waiting,
        "ended": call.run.status in Run.TERMINAL,
        "may_reconcile": waiting
        and current
        and tool.reconcile is not None
        # an unsafe tool has no trustworthy lookup: a person decides
        and call.effect != Effect.UNSAFE,
        "may_redispatch": waiting and current,
        "latest_lookup": latest_lookup,
        # marking it failed needs this proof, or the person's attestation (toolcall_resolve)
        "absence_proven": selectors.toolcall_absence_proven(call=call, latest_lookup=latest_lookup),
        "form": form,
        "outcome": form.data.get("outcome", "") if form is not None else "",
        "error": error,
    }


def _history(
    events: list[RunEvent], masks: dict[Any, Masker]
) -> dict[tuple[Any, int], list[timeline.Entry]]:
    return timeline.reconciliation_history(events, masks=masks)


@login_required
@require_GET
def unknown_inbox(request: HtmxHttpRequest) -> HttpResponse:
    if not _may_view(request.user):
        return _refused(request, "see unknown tool outcomes", "runs.view_toolcall")
    calls, events, total = selectors.unknown_outcomes(limit=selectors.UNKNOWN_SHOWN)
    masks = maskers_for({c.run_id: c.run for c in calls}.values(), user=request.user)
    history = _history(events, masks)
    tools = _Tools()
    lookups = selectors.toolcall_latest_lookups(events)
    rows = [
        _row(
            c,
            history.get((c.run_id, c.step.seq), []),
            tools,
            masks[c.run_id],
            latest_lookup=lookups.get((c.run_id, c.step.seq)),
        )
        for c in calls
    ]
    context = {
        "waiting": [r for r in rows if r["waiting"]],
        "automatic": [r for r in rows if not r["waiting"] and not r["ended"]],
        "ended": [r for r in rows if r["ended"]],
        "total": total,
        "shown": len(rows),
        "may_resolve": request.user.has_perm(RESOLVE),
    }
    template = "runs/unknown.html#outcome-list" if request.htmx else "runs/unknown.html"
    return render(request, template, context)


def _refused(request: HtmxHttpRequest, what: str, perm: str) -> HttpResponse:
    template = "runs/_refused.html#refusal" if request.htmx else "runs/_refused.html"
    context = {"what": what, "perm": perm, "run_id": None}
    return render(request, template, context, status=403)


@login_required
@require_POST
def toolcall_resolve_view(request: HtmxHttpRequest, call_id: int) -> HttpResponse:
    if not request.user.has_perm(RESOLVE):
        return _refused(request, "resolve unknown tool outcomes", RESOLVE)
    if call_id > BIGINT_MAX:
        # no such row, and SQLite cannot even bind the number: a 404, not a 500
        raise Http404("no such tool call")
    try:
        call, events = selectors.unknown_outcome_get(tool_call_id=call_id)
    except ToolCall.DoesNotExist:
        raise Http404("no such tool call") from None
    form = ResolveForm(request.POST, call=call)
    if not form.is_valid():
        return _row_response(request, call, events, form=form, status=400)
    data = form.cleaned_data
    try:
        # the service owns its savepoint: a refusal inside it does not break an outer
        # transaction (a test case, ATOMIC_REQUESTS) that the error page still reads from
        services.toolcall_resolve(
            tool_call_id=call.id,
            outcome=data["outcome"],
            actor=Actor.for_user(request.user, "web"),
            external_ref=data["external_ref"].strip(),
            result=data["result"],
            confirm_risk=data["confirm_risk"],
            attestation=data["attestation"],
        )
    except ActorPermissionDenied:
        return _refused(request, "resolve unknown tool outcomes", RESOLVE)
    except services.UnsafeDispatchUnconfirmed as exc:
        form.add_error("confirm_risk", str(exc))
        return _row_response(request, call, events, form=form, status=400)
    except services.AttestationRequired as exc:
        form.add_error("attestation", str(exc))
        return _row_response(request, call, events, form=form, status=400)
    except services.InvalidInput as exc:
        return _row_response(request, call, events, form=form, error=str(exc), status=400)
    except services.InvalidState as exc:
        return _row_response(request, call, events, form=form, error=str(exc), status=409)
    label = dict(form.fields["outcome"].choices)[data["outcome"]]
    message = (
        f"Call #{call.step.seq} ({call.tool_name}) resolved: {label.lower()}. "
        "The run is queued again."
    )
    if request.htmx:
        call, events = selectors.unknown_outcome_get(tool_call_id=call.id)
        context = {"resolved": True, "call": call, "run": call.run, "message": message}
        response = render(request, "runs/unknown.html#resolved-row", context)
        # runs-changed: the console's counters (runs.views.console) refresh too
        response["HX-Trigger"] = "outcomes-changed, runs-changed"
        return response
    messages.success(request, message)
    return redirect("runs:unknown")


def _row_response(
    request: HtmxHttpRequest,
    call: ToolCall,
    events: list[RunEvent],
    *,
    form: ResolveForm,
    error: str = "",
    status: int,
) -> HttpResponse:
    """The call's card with the form's errors or the refusal; nothing was changed. htmx gets
    the card (base.html tells htmx to swap 4xx answers in); a plain POST a page of its own."""
    masks = maskers_for([call.run], user=request.user)
    history = _history(events, masks).get((call.run_id, call.step.seq), [])
    lookup = selectors.toolcall_latest_lookups(events).get((call.run_id, call.step.seq))
    row = _row(
        call, history, _Tools(), masks[call.run_id], latest_lookup=lookup, form=form, error=error
    )
    may_resolve = request.user.has_perm(RESOLVE)
    template = "runs/unknown.html#outcome-row" if request.htmx else "runs/unknown_resolve.html"
    return render(
        request,
        template,
        {"row": row, "may_resolve": may_resolve},
        status=status,
    )


# --- triage: many unknown outcomes at once, by tool and time window (issue 21 item 4) ------

TRIAGE_OUTCOMES = [
    (Resolution.RECONCILE, "Reconcile again"),
    (Resolution.NOT_HAPPENED, "Mark as not happened"),
    (Resolution.DISPATCH_AGAIN, "Dispatch again with the same key"),
]


class TriageFilter(forms.Form):
    """The page's query string; invalid values are dropped (a stale link lists everything)."""

    tool = forms.CharField(max_length=100, required=False, strip=True)
    since = forms.DateTimeField(required=False)
    until = forms.DateTimeField(required=False)

    def values(self) -> dict[str, Any]:
        self.is_valid()
        cleaned = getattr(self, "cleaned_data", {})
        return {name: cleaned.get(name) or None for name in self.fields}


class TriageForm(forms.Form):
    outcome = forms.ChoiceField(choices=TRIAGE_OUTCOMES)
    call = forms.TypedMultipleChoiceField(coerce=int, choices=[])
    attestation = UnclippedCharField(
        required=False, max_length=services.ATTESTATION_MAX, widget=forms.Textarea
    )

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        ids = self.data.getlist("call") if hasattr(self.data, "getlist") else []
        self.fields["call"].choices = [(i, i) for i in ids[: selectors.UNKNOWN_SHOWN]]


def _triage_rows(calls: list[ToolCall], events: list[RunEvent], user: Any) -> list[dict[str, Any]]:
    masks = maskers_for({c.run_id: c.run for c in calls}.values(), user=user)
    lookups = selectors.toolcall_latest_lookups(events)
    rows = []
    for call in calls:
        lookup = lookups.get((call.run_id, call.step.seq))
        shown = masks[call.run_id](call.arguments_masked)
        rows.append(
            {
                "call": call,
                "shown_arguments": shown,
                "latest_lookup": lookup,
                "absence_proven": selectors.toolcall_absence_proven(
                    call=call, latest_lookup=lookup
                ),
            }
        )
    return rows


@login_required
@require_http_methods(["GET", "HEAD", "POST"])
def unknown_triage(request: HtmxHttpRequest) -> HttpResponse:
    """The unknown outcomes waiting for a person, by tool and time window, each with its
    latest lookup; one resolution for the selected ones, each through ``toolcall_resolve``
    on its own (one refusal stops none of the others). Marking failed — and sending an
    unsafe call again — is allowed where a lookup that started after the landing deadline
    answered absent; for every other call the attestation given here is recorded, and
    without one the service refuses that call."""
    if not _may_view(request.user):
        return _refused(request, "see unknown tool outcomes", "runs.view_toolcall")
    values = TriageFilter(request.GET).values()
    results: dict[int, tuple[bool, str]] = {}
    form = None
    if request.method == "POST":
        if not request.user.has_perm(RESOLVE):
            return _refused(request, "resolve unknown tool outcomes", RESOLVE)
        form = TriageForm(request.POST)
        if form.is_valid():
            results = _triage_resolve(request, form.cleaned_data)
    calls, events = selectors.unknown_for_triage(
        tool=values["tool"] or "", since=values["since"], until=values["until"]
    )
    done = [i for i in results if i not in {c.id for c in calls}]
    if done:  # resolved calls leave the list: show them with their result too
        gone = list(ToolCall.objects.select_related("step", "run").filter(id__in=done))
        calls = [*calls, *gone]
    context = {
        "rows": _triage_rows(calls, events, request.user),
        "results": results,
        "form": form,
        "filters": {k: request.GET.get(k, "") for k in ("tool", "since", "until")},
        "tools": [tool.name for tool in registry.tools() if tool.effect != Effect.READ],
        "outcomes": TRIAGE_OUTCOMES,
        "may_resolve": request.user.has_perm(RESOLVE),
    }
    status = 400 if form is not None and not form.is_valid() else 200
    response = render(request, "runs/unknown_triage.html", context, status=status)
    if results:
        response["HX-Trigger"] = "outcomes-changed, runs-changed"
    return response


def _triage_resolve(request: HtmxHttpRequest, data: dict[str, Any]) -> dict[int, tuple[bool, str]]:
    actor = Actor.for_user(request.user, "web")
    attestation = data["attestation"].strip()
    results: dict[int, tuple[bool, str]] = {}
    for call_id in dict.fromkeys(data["call"]):
        if call_id > BIGINT_MAX:
            results[call_id] = (False, "no such tool call")
            continue
        try:
            services.toolcall_resolve(
                tool_call_id=call_id,
                outcome=data["outcome"],
                actor=actor,
                # an unsafe call is sent again only on the person's recorded word
                confirm_risk=bool(attestation),
                attestation=attestation,
            )
        except ToolCall.DoesNotExist:
            results[call_id] = (False, "no such tool call")
        except ActorPermissionDenied as exc:
            results[call_id] = (False, str(exc))
        except (services.InvalidInput, services.InvalidState) as exc:
            results[call_id] = (False, str(exc))
        else:
            results[call_id] = (True, dict(TRIAGE_OUTCOMES)[data["outcome"]].lower())
    return results

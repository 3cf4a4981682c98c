"""The operator console, part 1: the dashboard, the runs list, starting runs and bulk actions.

Views stay thin: parse, call a selector or a service, render. Every page is one template
with named partials; an htmx request (the periodic refresh, or an action) gets only the
partial it asked for. Every state change is a POST with CSRF and goes through the same
service the API calls, which checks permission and writes the run's event naming the
operator.
"""

from __future__ import annotations

import json
import uuid
from datetime import datetime
from typing import Any

from django import forms
from django.contrib import messages
from django.contrib.auth.decorators import login_required, permission_required
from django.http import HttpResponse, QueryDict
from django.shortcuts import redirect, render
from django.urls import NoReverseMatch, reverse
from django.utils.http import url_has_allowed_host_and_scheme
from django.views.decorators.http import require_http_methods, require_POST

from runs import jsonlimits, selectors, services, spend
from runs.actors import Actor
from runs.actors import PermissionDenied as ActorPermissionDenied
from runs.forms import UnclippedCharField
from runs.models import Run
from runs.needs_you import needs_you
from runs.record.checkpoint import RunNotFound
from runs.registry import UnknownAgent, registry
from runs.timeline import EVENT_TYPES
from runs.views import HtmxHttpRequest

# the HX-Trigger event that makes counters and tables on the page refresh at once
RUNS_CHANGED = "runs-changed"
BULK_LIMIT = 100


def _status_counts(counts: dict[str, int]) -> list[dict[str, Any]]:
    return [
        {"status": value, "label": label, "count": counts[value]}
        for value, label in Run.Status.choices
    ]


# --- dashboard -------------------------------------------------------------------------------


@login_required
@permission_required("runs.view_run", raise_exception=True)
def dashboard(request: HtmxHttpRequest) -> HttpResponse:
    """What needs me now: counts, the "needs me" list, worker health, recent events."""
    counts = selectors.run_status_counts()
    context = {
        "status_counts": _status_counts(counts),
        "total": sum(counts.values()),
        "needs_you": needs_you(user=request.user),
        "health": selectors.worker_health(),
        "events": selectors.recent_events(limit=20),
        "alerts": selectors.recent_alerts(limit=10),
        "undelivered": selectors.undelivered_messages(limit=10),
        # each capped scope with what it has left (runs.spend): one query with no cap
        "spend": spend.scope_views(),
    }
    template = "runs/dashboard.html#dashboard-live" if request.htmx else "runs/dashboard.html"
    return render(request, template, context)


@login_required
def needs_you_badge(request: HtmxHttpRequest) -> HttpResponse:
    """The navigation's "Needs you" link with its count, loaded by htmx after the page (and
    refreshed with it): no page pays the queries before it is shown."""
    return render(
        request, "runs/_needs_you_badge.html", {"needs_you": needs_you(user=request.user)}
    )


# --- runs list -------------------------------------------------------------------------------


class RunFilter(forms.Form):
    """The list's query string. Anything invalid is dropped, not an error: a stale bookmark
    shows every run rather than an error page."""

    status = forms.ChoiceField(choices=[("", "any status"), *Run.Status.choices], required=False)
    reason = forms.ChoiceField(choices=[("", "any reason"), *Run.Reason.choices], required=False)
    agent = forms.CharField(max_length=100, required=False)
    tool = forms.CharField(max_length=100, required=False, strip=True)
    principal = forms.CharField(max_length=150, required=False, strip=True)
    key = forms.CharField(max_length=200, required=False, strip=True)
    # created at or after / before: the browser's local time, like the budget's deadline
    since = forms.DateTimeField(required=False)
    until = forms.DateTimeField(required=False)
    q = forms.CharField(max_length=200, required=False, strip=True)
    sort = forms.ChoiceField(
        choices=[
            ("-created", "newest first"),
            ("created", "oldest first"),
            ("-updated", "recently updated"),
            ("updated", "least recently updated"),
            ("status", "status"),
        ],
        required=False,
    )
    after = forms.CharField(max_length=500, required=False)
    before = forms.CharField(max_length=500, required=False)

    def values(self) -> dict[str, str]:
        """Each valid filter as the text it came in (for links that keep it)."""
        self.is_valid()
        cleaned = getattr(self, "cleaned_data", {})
        values = {}
        for name in self.fields:
            value = cleaned.get(name)
            # a time keeps the text it was given (a parsed datetime would not round-trip
            # through the form's local-time input)
            values[name] = self.data.get(name, "") if isinstance(value, datetime) else value or ""
        return values

    def moments(self) -> dict[str, Any]:
        """The valid time filters, parsed."""
        self.is_valid()
        cleaned = getattr(self, "cleaned_data", {})
        return {name: cleaned.get(name) for name in ("since", "until")}


# the filters that narrow the list (sort and the pager's cursors only order and page it)
NARROWING = ("status", "reason", "agent", "tool", "principal", "key", "since", "until", "q")


def _filter_query(values: dict[str, str], **override: str) -> str:
    """The filters as a query string (empty ones left out), e.g. for the pager's links."""
    query = QueryDict(mutable=True)
    for name, value in {**values, **override}.items():
        if value:
            query[name] = value
    return query.urlencode()


@login_required
@permission_required("runs.view_run", raise_exception=True)
def run_list(request: HtmxHttpRequest) -> HttpResponse:
    run_filter = RunFilter(request.GET)
    values = run_filter.values()
    # the status counts are the one aggregate on this page: rendered with the page and
    # refreshed on their own, slower schedule (and after an action), not with every row poll
    if request.htmx and request.htmx.target == "run-counts":
        counts = selectors.run_status_counts(agent=values["agent"] or None)
        return render(
            request,
            "runs/list.html#run-counts",
            {"status_counts": _status_counts(counts), "total": sum(counts.values()), **values},
        )
    runs = selectors.run_search(
        status=values["status"],
        reason=values["reason"],
        agent=values["agent"],
        tool=values["tool"],
        principal=values["principal"],
        key=values["key"],
        text=values["q"],
        **run_filter.moments(),
    )
    page = selectors.run_page(
        runs, sort=values["sort"] or "-created", after=values["after"], before=values["before"]
    )
    filters = {k: values[k] for k in (*NARROWING, "sort")}
    context: dict[str, Any] = {
        "page": page,
        "runs": page.runs,
        "filters": filters,
        "filtered": any(filters[k] for k in NARROWING),
        "more_filters": any(filters[k] for k in NARROWING if k not in ("status", "agent", "q")),
        "next_query": _filter_query(filters, after=page.next_cursor) if page.next_cursor else "",
        "prev_query": _filter_query(filters, before=page.prev_cursor) if page.prev_cursor else "",
        "self_query": request.GET.urlencode(),
        "first_query": _filter_query(filters),
        "paged": bool(values["after"] or values["before"]),
        "bulk_limit": BULK_LIMIT,
        **values,
    }
    if request.htmx:
        return render(request, "runs/list.html#runs-table", context)
    counts = selectors.run_status_counts(agent=values["agent"] or None)
    context.update(
        status_counts=_status_counts(counts),
        total=sum(counts.values()),
        agents=selectors.run_agent_names(),
        filter_form=RunFilter(request.GET),
    )
    return render(request, "runs/list.html", context)


# --- search events ----------------------------------------------------------------------------


class EventFilter(forms.Form):
    """The events page's query string; invalid values are dropped, as on the runs list."""

    type = forms.CharField(max_length=50, required=False, strip=True)
    actor = forms.CharField(max_length=200, required=False, strip=True)
    run = forms.CharField(max_length=36, required=False, strip=True)
    since = forms.DateTimeField(required=False)
    until = forms.DateTimeField(required=False)
    before = forms.IntegerField(min_value=1, required=False)


@login_required
@permission_required("runs.view_runevent", raise_exception=True)
def event_list(request: HtmxHttpRequest) -> HttpResponse:
    """Every run's events, searchable by type, actor, run and time; each filter in the URL."""
    event_filter = EventFilter(request.GET)
    event_filter.is_valid()
    cleaned = event_filter.cleaned_data
    events, next_before = selectors.event_search(
        type=cleaned.get("type") or "",
        actor=cleaned.get("actor") or "",
        run=cleaned.get("run") or "",
        since=cleaned.get("since"),
        until=cleaned.get("until"),
        before=cleaned.get("before"),
    )
    # the filters as they came in (times keep their local-time text), for links that keep them
    filters = {
        name: request.GET.get(name, "") if cleaned.get(name) else ""
        for name in ("type", "actor", "run", "since", "until")
    }
    return render(
        request,
        "runs/event_list.html",
        {
            "events": events,
            "filters": filters,
            "filtered": any(filters.values()),
            "event_types": EVENT_TYPES,
            "next_query": _filter_query(filters, before=str(next_before)) if next_before else "",
            "first_query": _filter_query(filters) if cleaned.get("before") else "",
        },
    )


# --- start a run -----------------------------------------------------------------------------


class StartRunForm(forms.Form):
    agent = forms.ChoiceField(choices=())
    goal = UnclippedCharField(
        max_length=2000,
        required=False,
        widget=forms.TextInput(attrs={"placeholder": "What should the agent achieve?"}),
    )
    input = forms.CharField(
        label="Input (JSON)",
        initial="{}",
        widget=forms.Textarea(attrs={"rows": 8, "class": "json", "spellcheck": "false"}),
        help_text="A JSON object, checked against the agent's input schema.",
    )
    max_steps = forms.IntegerField(
        label="Step budget",
        min_value=1,
        max_value=1_000_000,
        required=False,
        help_text="Leave empty for the default.",
    )
    dry_run = forms.BooleanField(
        label="Dry run",
        required=False,
        help_text="The agent runs for real, but every tool with a side effect only says what "
        "it would do; nothing is sent. A finished dry run can be promoted to a real run.",
    )

    def __init__(self, *args: Any, agents: list[str], **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.fields["agent"].choices = [(name, name) for name in agents]

    def clean_input(self) -> dict[str, Any]:
        raw = self.cleaned_data["input"]
        try:
            value = jsonlimits.loads(raw)
        except jsonlimits.JsonRejected as exc:
            raise forms.ValidationError(f"{exc.detail}.", code=exc.code) from None
        except ValueError as exc:
            raise forms.ValidationError(f"This is not valid JSON: {exc}") from None
        if not isinstance(value, dict):
            raise forms.ValidationError("The input must be a JSON object ({...}).")
        return value


def _agent_schemas(agents: list[str]) -> list[dict[str, Any]]:
    schemas = []
    for name in agents:
        try:
            agent = registry.agent(name)
        except UnknownAgent:
            continue
        schemas.append(
            {
                "name": name,
                "version": agent.version,
                "schema": json.dumps(agent.input_schema, indent=2, sort_keys=True),
            }
        )
    return schemas


def _detail_url(run_id: Any) -> str:
    # the run page is A2's (runs:detail); until it exists, the list filtered to this run
    try:
        return reverse("runs:detail", args=[run_id])
    except NoReverseMatch:
        return reverse("runs:list") + "?q=" + str(run_id)


@login_required
@permission_required("runs.start_run", raise_exception=True)
@require_http_methods(["GET", "HEAD", "POST"])
def run_start(request: HtmxHttpRequest) -> HttpResponse:
    agents = selectors.run_agent_names()
    status = 200
    if request.method == "POST":
        form = StartRunForm(request.POST, agents=agents)
        if form.is_valid():
            try:
                run = services.run_create(
                    agent_name=form.cleaned_data["agent"],
                    goal=form.cleaned_data["goal"],
                    input=form.cleaned_data["input"],
                    max_steps=form.cleaned_data["max_steps"],
                    dry_run=form.cleaned_data["dry_run"],
                    actor=Actor.for_user(request.user, "web"),
                )
            except UnknownAgent:
                form.add_error("agent", "This agent is no longer registered.")
            except services.DryRunUnsupported as exc:
                form.add_error("dry_run", str(exc))
            except services.InvalidInput as exc:
                form.add_error("input", str(exc))
            except ActorPermissionDenied as exc:
                form.add_error(None, str(exc))
                status = 403
            else:
                kind = "Dry run" if run.dry_run else "Run"
                messages.success(request, f"{kind} {str(run.id)[:8]} started ({run.agent_name}).")
                return redirect(_detail_url(run.id))
        status = status if status != 200 else 400
    else:
        chosen = request.GET.get("agent", "")
        initial = {"agent": chosen if chosen in agents else (agents[0] if agents else "")}
        form = StartRunForm(initial=initial, agents=agents)
    context = {"form": form, "schemas": _agent_schemas(agents), "agents": agents}
    return render(request, "runs/start.html", context, status=status)


# --- bulk actions ----------------------------------------------------------------------------


class BulkForm(forms.Form):
    ACTIONS = [("terminate", "Terminate"), ("retry", "Retry recovery")]
    action = forms.ChoiceField(
        choices=ACTIONS,
        error_messages={"required": "Choose an action.", "invalid_choice": "Choose an action."},
    )
    reason = UnclippedCharField(max_length=2000, required=False, strip=True)
    next = forms.CharField(max_length=2000, required=False)

    def clean(self) -> dict[str, Any]:
        cleaned = super().clean()
        # the selected rows: any run ids; whether each may be acted on is the service's answer
        ids = []
        for value in self.data.getlist("run"):
            try:
                ids.append(str(uuid.UUID(value)))
            except ValueError:
                raise forms.ValidationError(f"{value[:40]!r} is not a run id.") from None
        ids = list(dict.fromkeys(ids))
        if not ids:
            raise forms.ValidationError("Select at least one run.")
        if len(ids) > BULK_LIMIT:
            raise forms.ValidationError(f"Select at most {BULK_LIMIT} runs at a time.")
        cleaned["runs"] = ids
        if cleaned.get("action") == "terminate" and not cleaned.get("reason"):
            self.add_error("reason", "Say why these runs are terminated: it goes on each timeline.")
        return cleaned


def _bulk_apply(action: str, run_ids: list[str], reason: str, actor: Actor) -> list[dict]:
    """Each run on its own: one run refusing (already finished, not dead-lettered) does
    not stop the others, and each result says what happened and why."""
    results = []
    for run_id in run_ids:
        try:
            # each service owns its savepoint: a refusal rolls back that run only, also when
            # the caller is itself inside a transaction (tests, ATOMIC_REQUESTS)
            if action == "terminate":
                run = services.run_terminate(run_id=run_id, actor=actor, reason=reason)
            else:
                run = services.run_retry_recovery(run_id=run_id, actor=actor)
            if action == "terminate":
                outcome = (
                    "terminated"
                    if run.status == Run.Status.TERMINATED
                    else "termination requested: the worker stops it at its next checkpoint"
                )
            else:
                outcome = "queued for another recovery"
        except (Run.DoesNotExist, RunNotFound):
            results.append({"run_id": run_id, "ok": False, "message": "no such run"})
        except (
            services.InvalidState,
            services.InvalidInput,
            ActorPermissionDenied,
        ) as exc:
            results.append({"run_id": run_id, "ok": False, "message": str(exc)})
        else:
            results.append({"run_id": run_id, "ok": True, "message": outcome, "status": run.status})
    return results


def _safe_next(request: HtmxHttpRequest, target: str) -> str:
    if target and url_has_allowed_host_and_scheme(
        target, allowed_hosts={request.get_host()}, require_https=request.is_secure()
    ):
        return target
    return reverse("runs:list")


def _bulk_refused(request: HtmxHttpRequest, error: str, status: int) -> HttpResponse:
    if request.htmx:
        return render(request, "runs/list.html#bulk-results", {"error": error}, status=status)
    # without JavaScript: the reason on a page of its own, with the way back
    back = _safe_next(request, request.POST.get("next", ""))
    return render(request, "runs/bulk_refused.html", {"error": error, "back": back}, status=status)


@login_required
@require_POST
def run_bulk(request: HtmxHttpRequest) -> HttpResponse:
    """Terminate (with a reason) or retry recovery of the selected runs; per-run results."""
    if not request.user.has_perm("runs.operate_run"):
        return _bulk_refused(
            request, "You may not operate runs: that needs the operator role.", 403
        )
    form = BulkForm(request.POST)
    if not form.is_valid():
        errors = [str(e) for field_errors in form.errors.values() for e in field_errors]
        return _bulk_refused(request, " ".join(errors), 400)
    action = form.cleaned_data["action"]
    results = _bulk_apply(
        action,
        form.cleaned_data["runs"],
        form.cleaned_data["reason"],
        Actor.for_user(request.user, "web"),
    )
    done = sum(1 for r in results if r["ok"])
    summary = f"{dict(BulkForm.ACTIONS)[action]}: {done} of {len(results)} runs done" + (
        f", {len(results) - done} refused." if done < len(results) else "."
    )
    if request.htmx:
        response = render(
            request, "runs/list.html#bulk-results", {"results": results, "summary": summary}
        )
        response["HX-Trigger"] = RUNS_CHANGED
        return response
    # without JavaScript: the results as messages on the list the operator came from
    level = messages.SUCCESS if done == len(results) else messages.WARNING
    messages.add_message(request, level, summary)
    for result in results:
        short = result["run_id"][:8]
        if result["ok"]:
            messages.success(request, f"{short}: {result['message']}")
        else:
            messages.error(request, f"{short}: refused — {result['message']}")
    return redirect(_safe_next(request, form.cleaned_data["next"]))

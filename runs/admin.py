"""Admin for auditors (issue 8): every model is here, and the record is read-only for
everyone, superusers included. State changes happen only as admin actions that call the
services (``run_terminate``, ``run_retry_recovery``, ...), which check permission and append a
run event naming the actor with channel ``admin``.

Built for 100,000 runs and 1,000,000 events: no per-row queries (``list_select_related``,
columns that read only the row), capped counts instead of full table counts, list filters that
need no ``SELECT DISTINCT`` over big tables, and exact-match search that uses the indexes.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Callable
from datetime import datetime, time, timedelta
from typing import Any

from axes.models import AccessAttempt
from django import forms
from django.contrib import admin, messages
from django.contrib.admin import helpers
from django.contrib.admin.options import IncorrectLookupParameters
from django.contrib.auth import get_user_model
from django.contrib.auth.admin import GroupAdmin, UserAdmin
from django.contrib.auth.models import Group
from django.core.exceptions import PermissionDenied as DjangoPermissionDenied
from django.core.paginator import Paginator
from django.db import transaction
from django.db.models import Max, Min, Q, QuerySet
from django.http import HttpRequest, HttpResponse, StreamingHttpResponse
from django.template.response import TemplateResponse
from django.urls import path, reverse
from django.utils import timezone
from django.utils.functional import cached_property
from django.utils.html import format_html
from django_q.models import Failure, OrmQ, Schedule, Success

from runs.actors import Actor, PermissionDenied
from runs.audit import (
    audit_record,
    csv_lines,
    group_snapshot,
    keyset_iterate,
    unlocking_as,
    user_roles_snapshot,
)
from runs.masking import UNMASKED, Masker, masked_rows, maskers_for_ids
from runs.models import (
    AgentManifest,
    Alert,
    ApiToken,
    AuditEntry,
    IdempotentRequest,
    OutboxMessage,
    Question,
    QuestionLink,
    Run,
    RunEvent,
    RunMessage,
    Signal,
    Step,
    ToolCall,
    ToolCapacity,
    ToolLimit,
    ToolReceipt,
    ToolShare,
    ToolWaiter,
    WebhookDelivery,
    Worker,
)
from runs.record.eventtypes import EventType
from runs.services import (
    InvalidInput,
    InvalidState,
    run_pause,
    run_resume,
    run_retry_recovery,
    run_terminate,
)
from runs.tokens import api_token_create, api_token_revoke

# --- building blocks --------------------------------------------------------------------------


class CappedCountPaginator(Paginator):
    """Counts at most ``COUNT_CAP`` + 1 rows (``SELECT COUNT(*) FROM (... LIMIT n)``) instead of
    the whole filtered table: on a million events an exact count is the slowest query of the
    page and tells an auditor nothing a narrower filter would not. The pagination template
    shows "more than N" when the cap is reached."""

    COUNT_CAP = 10_000

    @cached_property
    def count(self) -> int:
        counted = self.object_list.order_by()[: self.COUNT_CAP + 1].count()
        self.count_capped = counted > self.COUNT_CAP
        return counted

    count_capped = False


_CANONICAL_UUID = re.compile(
    r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}", re.IGNORECASE
)


def _as_uuid(term: str) -> uuid.UUID | None:
    """A run id as people paste it (with dashes). 32 bare hex digits are not taken for one:
    that is what a trace id looks like."""
    term = term.strip()
    return uuid.UUID(term) if _CANONICAL_UUID.fullmatch(term) else None


class BucketProbeQuerySetMixin:
    """The date hierarchy without ``SELECT DISTINCT date_trunc(...)`` over every row.

    Django lists the years / months / days that have rows by truncating every row's date;
    on a million events that is the slowest query of the page. Here: MIN/MAX of the column
    (index ends), then one ``LIMIT 1`` probe per candidate bucket (at most 31 on a month's
    page, 12 on a year's), each an index range scan that stops at its first row."""

    MAX_PROBES = 64

    def datetimes(self, field_name, kind, order="ASC", tzinfo=None):
        if kind not in ("year", "month", "day"):
            return super().datetimes(field_name, kind, order, tzinfo)
        bounds = self.aggregate(first=Min(field_name), last=Max(field_name))
        if bounds["first"] is None:
            return []
        tz = tzinfo or timezone.get_current_timezone()
        starts = _bucket_starts(bounds["first"].astimezone(tz), bounds["last"].astimezone(tz), kind)
        if len(starts) > self.MAX_PROBES:
            return super().datetimes(field_name, kind, order, tzinfo)
        ends = [*starts[1:], _next_bucket(starts[-1], kind)]
        found = [
            start
            for start, end in zip(starts, ends, strict=True)
            if self._has_rows(field_name, start, end)
        ]
        return found if order == "ASC" else found[::-1]

    def _has_rows(self, field_name: str, start: datetime, end: datetime) -> bool:
        # ORDER BY the column (not a bare EXISTS): with LIMIT 1 the planner then walks the
        # column's index from the bucket's start. A bare EXISTS may be planned as a sequential
        # scan that reads most of a table whose rows are in time order before its first match.
        probe = (
            self.filter(**{f"{field_name}__gte": start, f"{field_name}__lt": end})
            .order_by(field_name)
            .values_list(field_name, flat=True)[:1]
        )
        return bool(list(probe))


def _bucket_start(moment: datetime, kind: str) -> datetime:
    if kind == "year":
        return moment.replace(month=1, day=1, hour=0, minute=0, second=0, microsecond=0)
    if kind == "month":
        return moment.replace(day=1, hour=0, minute=0, second=0, microsecond=0)
    return moment.replace(hour=0, minute=0, second=0, microsecond=0)


def _next_bucket(start: datetime, kind: str) -> datetime:
    if kind == "year":
        return start.replace(year=start.year + 1)
    if kind == "month":
        year, month = divmod(start.month, 12)
        return start.replace(year=start.year + year, month=month + 1)
    # a calendar day in the local zone (23 or 25 hours across a DST change)
    following = (start.replace(tzinfo=None) + timedelta(days=1)).date()
    return datetime.combine(following, time.min, tzinfo=start.tzinfo)


def _bucket_starts(first: datetime, last: datetime, kind: str) -> list[datetime]:
    starts = [_bucket_start(first, kind)]
    while len(starts) <= BucketProbeQuerySetMixin.MAX_PROBES:
        following = _next_bucket(starts[-1], kind)
        if following > last:
            break
        starts.append(following)
    return starts


_PROBING_CLASSES: dict[type, type] = {}


def _with_bucket_probes(queryset: QuerySet) -> QuerySet:
    cls = queryset.__class__
    if cls not in _PROBING_CLASSES:
        _PROBING_CLASSES[cls] = type(f"Probing{cls.__name__}", (BucketProbeQuerySetMixin, cls), {})
    queryset.__class__ = _PROBING_CLASSES[cls]
    return queryset


class AuditAdmin(admin.ModelAdmin):
    """Shared behaviour: capped counts, exact search on indexed fields, a date hierarchy that
    probes instead of scanning, CSV export."""

    paginator = CappedCountPaginator
    show_full_result_count = False
    list_per_page = 50
    # Exact matches only: an ``icontains`` over a million rows cannot use an index. Each entry
    # is a field path; ``uuid_search_fields`` are searched (only) when the term is a UUID.
    exact_search_fields: tuple[str, ...] = ()
    uuid_search_fields: tuple[str, ...] = ()
    # (header, value of a row) for the CSV download of the filtered list; empty: no export
    export_columns: tuple[tuple[str, Callable[[Any], Any]], ...] = ()
    export_select_related: tuple[str, ...] = ()
    change_list_template = "admin/audit_change_list.html"
    SEARCH_MATCH_LIMIT = 1000

    def get_queryset(self, request: HttpRequest) -> QuerySet:
        return _with_bucket_probes(super().get_queryset(request))

    def get_search_fields(self, request: HttpRequest) -> list[str]:
        # the search box is shown when this is non-empty; the matching is ours (below)
        return [*self.uuid_search_fields, *self.exact_search_fields]

    def get_search_results(self, request: HttpRequest, queryset, search_term: str):
        term = search_term.strip()
        if not term:
            return queryset, False
        as_uuid = _as_uuid(term)
        if as_uuid is not None:
            lookups = [(field_path, as_uuid) for field_path in self.uuid_search_fields]
        else:
            lookups = [(field_path, term) for field_path in self.exact_search_fields]
        if not lookups:
            return queryset.none(), False
        # One indexed lookup per field, then the page by primary key. An OR across columns
        # of several joined tables can use no index and would scan them all; a join through
        # a to-many relation would also repeat rows and need a DISTINCT over the whole list.
        manager = self.model._default_manager
        matches: set[Any] = set()
        for field_path, value in lookups:
            found = list(
                manager.filter(**{field_path: value}).values_list("pk", flat=True)[
                    : self.SEARCH_MATCH_LIMIT + 1
                ]
            )
            if len(found) > self.SEARCH_MATCH_LIMIT:
                # a term matching a large share of the table (a busy worker's name): filter
                # by it directly instead of carrying a huge list of ids
                condition = Q()
                for path, term_value in lookups:
                    condition |= Q(pk__in=manager.filter(**{path: term_value}).values("pk"))
                return queryset.filter(condition), False
            matches.update(found)
        return queryset.filter(pk__in=matches), False

    # --- CSV export of the filtered changelist ---

    def get_urls(self):
        urls = super().get_urls()
        if not self.export_columns:
            return urls
        info = self.opts.app_label, self.opts.model_name
        return [
            path(
                "export/",
                self.admin_site.admin_view(self.export_view),
                name="{}_{}_export".format(*info),
            ),
            *urls,
        ]

    def changelist_view(self, request: HttpRequest, extra_context: dict | None = None):
        extra_context = dict(extra_context or {})
        if self.export_columns:
            extra_context["export_url"] = reverse(
                f"admin:{self.opts.app_label}_{self.opts.model_name}_export"
            )
        return super().changelist_view(request, extra_context)

    def export_view(self, request: HttpRequest) -> HttpResponse:
        """The changelist's filtered rows (filters, date hierarchy, search) as CSV, streamed
        in keyset-paginated chunks: constant memory whatever the range."""
        if not self.has_view_permission(request):
            raise DjangoPermissionDenied
        try:
            changelist = self.get_changelist_instance(request)
        except IncorrectLookupParameters:
            return HttpResponse("unknown filter in the query string", status=400)
        queryset = changelist.get_queryset(request)
        if self.export_select_related:
            queryset = queryset.select_related(*self.export_select_related)
        headers = [header for header, _ in self.export_columns]
        objects = keyset_iterate(queryset)
        if self.masked_fields:
            objects = masked_rows(
                objects, run_id=self.masked_run_id, fields=self.masked_fields, user=request.user
            )
        rows = ({header: value(obj) for header, value in self.export_columns} for obj in objects)
        stamp = timezone.now().strftime("%Y%m%d-%H%M%S")
        response = StreamingHttpResponse(csv_lines(headers, rows), content_type="text/csv")
        response["Content-Disposition"] = (
            f'attachment; filename="{self.opts.model_name}-{stamp}.csv"'
        )
        return response


class ReadOnlyAdmin(AuditAdmin):
    """The record: nobody adds, changes or deletes here, superusers included."""

    def has_add_permission(self, request, obj=None):
        return False

    def has_change_permission(self, request, obj=None):
        return False

    def has_delete_permission(self, request, obj=None):
        return False

    # Sensitive tool output (runs.masking) is masked on the object's page unless the viewer
    # holds runs.view_sensitive. The object is only shown (nobody may change it here), so
    # it is masked in place. ``masked_fields`` are masked by value; ``mask_object`` may do
    # more (a result masked by its tool's declared paths).
    masked_fields: tuple[str, ...] = ()

    def masked_run_id(self, obj: Any) -> Any:
        return obj.run_id

    def mask_object(self, obj: Any, mask: Masker) -> None:
        for name in self.masked_fields:
            setattr(obj, name, mask(getattr(obj, name)))

    def get_object(self, request, object_id, from_field=None):
        obj = super().get_object(request, object_id, from_field)
        if obj is not None and self.masked_fields:
            run_id = self.masked_run_id(obj)
            masks = maskers_for_ids([run_id], user=request.user) if run_id else {}
            self.mask_object(obj, masks.get(run_id, UNMASKED))
        return obj


def run_link(run_id: Any) -> str:
    if run_id is None:
        return "-"
    url = reverse("admin:runs_run_change", args=[run_id])
    return format_html('<a href="{}">{}</a>', url, run_id)


class ActorKindFilter(admin.SimpleListFilter):
    """By kind of actor: a fixed list, so no ``SELECT DISTINCT actor`` over every event."""

    title = "actor"
    parameter_name = "actor_kind"

    def lookups(self, request, model_admin):
        return [
            ("user", "people (user:…)"),
            ("worker", "workers (worker:…)"),
            ("system", "system"),
            ("other", "other"),
        ]

    def queryset(self, request, queryset):
        value = self.value()
        if value in ("user", "worker"):
            return queryset.filter(actor__startswith=f"{value}:")
        if value == "system":
            return queryset.filter(actor="system")
        if value == "other":
            return queryset.exclude(
                Q(actor__startswith="user:") | Q(actor__startswith="worker:") | Q(actor="system")
            )
        return queryset


class EventTypeFilter(admin.SimpleListFilter):
    title = "type"
    parameter_name = "type"

    def lookups(self, request, model_admin):
        return sorted(EventType.choices)

    def queryset(self, request, queryset):
        return queryset.filter(type=self.value()) if self.value() else queryset


def _registered_names(kind: str) -> list[str]:
    """Agent or tool names from the registry (hosted) and the manifests (remote): the filter
    choices, without a ``SELECT DISTINCT`` over every run or call."""
    from runs.registry import registry

    if kind == "agent":
        names = {agent.name for agent in registry.agents()}
        names.update(AgentManifest.objects.values_list("name", flat=True))
    else:
        names = {tool.name for tool in registry.tools()}
        names.update(
            tool.get("name", "")
            for tools in AgentManifest.objects.values_list("tools", flat=True)
            for tool in (tools or [])
            if isinstance(tool, dict)
        )
    return sorted(name for name in names if name)


class AgentFilter(admin.SimpleListFilter):
    title = "agent"
    parameter_name = "agent"

    def lookups(self, request, model_admin):
        return [(name, name) for name in _registered_names("agent")]

    def queryset(self, request, queryset):
        return queryset.filter(agent_name=self.value()) if self.value() else queryset


class ToolFilter(admin.SimpleListFilter):
    """By tool, from the registry and manifests (no DISTINCT over every tool call)."""

    title = "tool"
    parameter_name = "tool"
    field_path = "tool_name"

    def lookups(self, request, model_admin):
        return [(name, name) for name in _registered_names("tool")]

    def queryset(self, request, queryset):
        if not self.value():
            return queryset
        return queryset.filter(**{self.field_path: self.value()})


class ReceiptToolFilter(ToolFilter):
    field_path = "tool_call__tool_name"


class FixedChoicesFilter(admin.SimpleListFilter):
    """A filter over a column whose values are a known, small set (channels, effects): the
    choices come from code, not from a ``SELECT DISTINCT`` over the table."""

    field_path = ""
    values: tuple[str, ...] = ()

    def lookups(self, request, model_admin):
        return [(value, value) for value in self.values]

    def queryset(self, request, queryset):
        if not self.value():
            return queryset
        return queryset.filter(**{self.field_path: self.value()})


class ChannelFilter(FixedChoicesFilter):
    title = "channel"
    parameter_name = "channel"
    field_path = "channel"
    values = tuple(RunEvent.Channel.values)


class EffectFilter(FixedChoicesFilter):
    title = "effect"
    parameter_name = "effect"
    field_path = "effect"
    values = ("read", "idempotent", "reconcilable", "unsafe")


# --- runs -------------------------------------------------------------------------------------


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
                # a savepoint per run: a refusal rolls back that run only, and leaves any
                # enclosing transaction usable for the next one
                with transaction.atomic():
                    run = run_terminate(
                        run_id=run_id, actor=actor, reason=form.cleaned_data["reason"]
                    )
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
            with transaction.atomic():  # see terminate_runs
                service(run_id=run_id, actor=actor, **kwargs)
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
        run_id = _as_uuid(str(object_id))
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


class ReceiptInline(admin.StackedInline):
    model = ToolReceipt
    extra = 0
    can_delete = False
    # the result on the receipt's own page, where it is masked for the viewer
    fields = ["outcome", "source", "external_ref", "result_link", "recorded_by", "incarnation"]
    readonly_fields = fields

    @admin.display(description="result")
    def result_link(self, obj: ToolReceipt) -> str:
        url = reverse("admin:runs_toolreceipt_change", args=[obj.pk])
        return format_html('<a href="{}">on the receipt\'s page</a>', url)

    def has_add_permission(self, request, obj=None):
        return False

    def has_change_permission(self, request, obj=None):
        return False

    def has_delete_permission(self, request, obj=None):
        return False


@admin.register(ToolCall)
class ToolCallAdmin(ReadOnlyAdmin):
    list_display = [
        "idempotency_key",
        "run_column",
        "tool_name",
        "tool_version",
        "effect",
        "status",
        "attempt_count",
        "external_ref",
        "dispatched_at",
    ]
    list_select_related = ["receipt"]
    list_filter = ["status", ToolFilter, EffectFilter]
    uuid_search_fields = ("run_id", "run__root_run_id")
    exact_search_fields = ("idempotency_key", "receipt__external_ref", "arguments_digest")
    date_hierarchy = "created_at"
    # the real arguments may hold sensitive values: only the masked copy is shown
    exclude = ["arguments"]
    inlines = [ReceiptInline]
    masked_fields = ("arguments_masked", "last_error")

    @admin.display(description="run", ordering="run_id")
    def run_column(self, obj: ToolCall) -> str:
        return run_link(obj.run_id)

    @admin.display(description="external ref")
    def external_ref(self, obj: ToolCall) -> str:
        receipt = getattr(obj, "receipt", None)  # a missing reverse one-to-one: None
        return receipt.external_ref if receipt else ""


@admin.register(ToolReceipt)
class ToolReceiptAdmin(ReadOnlyAdmin):
    list_display = [
        "external_ref",
        "tool_name",
        "idempotency_key",
        "run_column",
        "outcome",
        "source",
        "recorded_by",
        "created_at",
    ]
    list_select_related = ["tool_call"]
    list_filter = ["outcome", "source", ReceiptToolFilter]
    uuid_search_fields = ("tool_call__run_id",)
    exact_search_fields = ("external_ref", "tool_call__idempotency_key", "recorded_by")
    date_hierarchy = "created_at"

    masked_fields = ("result",)

    def masked_run_id(self, obj: ToolReceipt) -> Any:
        return obj.tool_call.run_id

    def mask_object(self, obj: ToolReceipt, mask: Masker) -> None:
        obj.result = mask.output(obj.tool_call.tool_name, obj.result)

    @admin.display(description="tool", ordering="tool_call__tool_name")
    def tool_name(self, obj: ToolReceipt) -> str:
        return obj.tool_call.tool_name

    @admin.display(description="idempotency key")
    def idempotency_key(self, obj: ToolReceipt) -> str:
        url = reverse("admin:runs_toolcall_change", args=[obj.tool_call_id])
        return format_html('<a href="{}">{}</a>', url, obj.tool_call.idempotency_key)

    @admin.display(description="run")
    def run_column(self, obj: ToolReceipt) -> str:
        return run_link(obj.tool_call.run_id)


@admin.register(RunEvent)
class RunEventAdmin(ReadOnlyAdmin):
    list_display = [
        "id",
        "run_column",
        "seq",
        "type",
        "actor",
        "channel",
        "incarnation",
        "created_at",
    ]
    list_filter = [EventTypeFilter, "channel", ActorKindFilter]
    uuid_search_fields = ("run_id",)
    exact_search_fields = ("actor", "type", "trace_id")
    date_hierarchy = "created_at"
    # newest first along the primary key: no sort over a million rows
    ordering = ["-id"]
    masked_fields = ("payload",)
    export_columns = (
        ("run_id", lambda e: e.run_id),
        ("seq", lambda e: e.seq),
        ("created_at", lambda e: e.created_at.isoformat()),
        ("type", lambda e: e.type),
        ("actor", lambda e: e.actor),
        ("channel", lambda e: e.channel),
        ("incarnation", lambda e: e.incarnation),
        ("payload", lambda e: e.payload),
        ("payload_digest", lambda e: e.payload_digest),
        ("prev_hash", lambda e: e.prev_hash),
        ("hash", lambda e: e.hash),
    )

    @admin.display(description="run", ordering="run_id")
    def run_column(self, obj: RunEvent) -> str:
        return run_link(obj.run_id)


@admin.register(Signal)
class SignalAdmin(ReadOnlyAdmin):
    list_display = [
        "name",
        "run_column",
        "idempotency_key",
        "sent_by",
        "channel",
        "received_at",
        "consumed_at",
    ]
    list_filter = [ChannelFilter]
    uuid_search_fields = ("run_id",)
    exact_search_fields = ("name", "idempotency_key", "sent_by")
    date_hierarchy = "received_at"

    @admin.display(description="run", ordering="run_id")
    def run_column(self, obj: Signal) -> str:
        return run_link(obj.run_id)


@admin.register(Question)
class QuestionAdmin(ReadOnlyAdmin):
    list_display = [
        "id",
        "run_column",
        "group",
        "status",
        "asked_at",
        "expires_at",
        "answered_by",
        "channel",
    ]
    list_select_related = ["answered_by"]
    list_filter = ["status", ChannelFilter]
    uuid_search_fields = ("run_id",)
    exact_search_fields = ("group", "answered_by__username")
    date_hierarchy = "asked_at"
    masked_fields = ("text",)

    @admin.display(description="run", ordering="run_id")
    def run_column(self, obj: Question) -> str:
        return run_link(obj.run_id)


@admin.register(QuestionLink)
class QuestionLinkAdmin(ReadOnlyAdmin):
    list_display = ["id", "question", "recipient", "created_at", "used_at"]
    list_select_related = ["question", "recipient"]
    uuid_search_fields = ("question__run_id",)
    exact_search_fields = ("recipient__username",)
    date_hierarchy = "created_at"
    # only a hash is stored, and even that tells an auditor nothing
    exclude = ["token_hash"]


@admin.register(Worker)
class WorkerAdmin(ReadOnlyAdmin):
    list_display = ["name", "host", "pid", "health", "started_at", "heartbeat_at", "last_task_at"]
    list_filter = ["health"]
    exact_search_fields = ("name", "host")


@admin.register(WebhookDelivery)
class WebhookDeliveryAdmin(ReadOnlyAdmin):
    list_display = [
        "id",
        "token",
        "event_type",
        "run_column",
        "status",
        "attempts",
        "last_status_code",
        "created_at",
        "delivered_at",
    ]
    list_select_related = ["token"]
    list_filter = ["status", "event_type"]
    uuid_search_fields = ("run_id",)
    exact_search_fields = ("token__name",)
    date_hierarchy = "created_at"
    masked_fields = ("payload",)

    @admin.display(description="run", ordering="run_id")
    def run_column(self, obj: WebhookDelivery) -> str:
        return run_link(obj.run_id)


@admin.register(OutboxMessage)
class OutboxMessageAdmin(ReadOnlyAdmin):
    """Every email the system sent or still owes (runs.outbox), for an auditor asking "was
    the approver told?". The payload is not shown: it holds the seed of the emailed link."""

    list_display = [
        "id",
        "kind",
        "to_address",
        "run_column",
        "status",
        "attempts",
        "created_at",
        "sent_at",
    ]
    list_filter = ["status", "kind"]
    uuid_search_fields = ("run_id",)
    exact_search_fields = ("to_address", "message_id")
    date_hierarchy = "created_at"
    exclude = ["payload", "claim_token"]

    @admin.display(description="run", ordering="run_id")
    def run_column(self, obj: OutboxMessage) -> str:
        return run_link(obj.run_id)


@admin.register(IdempotentRequest)
class IdempotentRequestAdmin(ReadOnlyAdmin):
    list_display = ["key", "principal", "run_column", "created_at"]
    list_select_related = ["principal"]
    uuid_search_fields = ("run_id",)
    exact_search_fields = ("key", "principal__username")
    date_hierarchy = "created_at"

    @admin.display(description="run", ordering="run_id")
    def run_column(self, obj: IdempotentRequest) -> str:
        return run_link(obj.run_id)


@admin.register(AgentManifest)
class AgentManifestAdmin(ReadOnlyAdmin):
    """Registered through ``PUT /api/v1/agents/{name}/`` (audited there), never edited here."""

    list_display = ["name", "version", "owner", "registered_by", "created_at", "updated_at"]
    exact_search_fields = ("name", "registered_by")


@admin.register(RunMessage)
class RunMessageAdmin(ReadOnlyAdmin):
    """A remote agent's conversation history (not authoritative, not in the hash chain).
    The messages themselves are not shown here: they may hold what the agent saw unmasked
    (only the agent's owner reads them, through the API)."""

    list_display = ["run_column", "seq", "size", "written_by", "incarnation", "created_at"]
    fields = ["run", "seq", "size", "digest", "written_by", "incarnation", "created_at"]
    uuid_search_fields = ("run_id",)
    date_hierarchy = "created_at"

    @admin.display(description="run", ordering="run_id")
    def run_column(self, obj: RunMessage) -> str:
        return run_link(obj.run_id)


@admin.register(ToolLimit)
class ToolLimitAdmin(ReadOnlyAdmin):
    """Operators' limits (set in the console or the API, audited there; docs/agents.md)."""

    list_display = [
        "tool_name",
        "max_in_flight",
        "rate",
        "per_seconds",
        "burst",
        "key_argument",
        "set_by",
    ]
    exact_search_fields = ("tool_name",)


@admin.register(ToolCapacity)
class ToolCapacityAdmin(ReadOnlyAdmin):
    """Each limited tool's (and key's) rate state, locked by the dispatch transaction."""

    list_display = ["tool_name", "limit_key", "tat", "grants"]
    exact_search_fields = ("tool_name",)


@admin.register(ToolShare)
class ToolShareAdmin(ReadOnlyAdmin):
    """Fair sharing: when each principal last got a slot of a limited tool."""

    list_display = ["tool_name", "limit_key", "share", "last_grant"]
    exact_search_fields = ("tool_name", "share")


@admin.register(ToolWaiter)
class ToolWaiterAdmin(ReadOnlyAdmin):
    """Runs waiting for capacity on a limited tool, and since when."""

    list_display = ["run_column", "tool_name", "limit_key", "share", "since"]
    exact_search_fields = ("tool_name",)
    uuid_search_fields = ("run_id",)

    @admin.display(description="run", ordering="run_id")
    def run_column(self, obj: ToolWaiter) -> str:
        return run_link(obj.run_id)


@admin.register(Alert)
class AlertAdmin(ReadOnlyAdmin):
    list_display = [
        "cause",
        "kind",
        "run_column",
        "worker_name",
        "created_at",
        "notified_at",
        "resolved_at",
    ]
    list_filter = ["kind"]
    uuid_search_fields = ("run_id",)
    exact_search_fields = ("cause", "worker_name")
    date_hierarchy = "created_at"

    @admin.display(description="run", ordering="run_id")
    def run_column(self, obj: Alert) -> str:
        return run_link(obj.run_id)


class AuditActionFilter(FixedChoicesFilter):
    title = "action"
    parameter_name = "action"
    field_path = "action"
    values = (
        "agent.registered",
        "agent.updated",
        "auth.locked_out",
        # written before issue 17; failures are counted by django-axes now
        "auth.sign_in_failed",
        "auth.signed_in",
        "auth.unlocked",
        "group.created",
        "group.deleted",
        "group.permissions_changed",
        "token.created",
        "token.revoked",
        "user.created",
        "user.deleted",
        "user.email_changed",
        "user.password_changed",
        "user.roles_changed",
    )


class AuditObjectTypeFilter(FixedChoicesFilter):
    title = "object type"
    parameter_name = "object_type"
    field_path = "object_type"
    values = ("agent", "api_token", "group", "user")


@admin.register(AuditEntry)
class AuditEntryAdmin(ReadOnlyAdmin):
    list_display = [
        "created_at",
        "action",
        "actor",
        "channel",
        "ip_address",
        "object_type",
        "object_id",
    ]
    list_filter = [AuditActionFilter, "channel", AuditObjectTypeFilter, ActorKindFilter]
    exact_search_fields = ("actor", "object_id", "ip_address", "action")
    date_hierarchy = "created_at"
    ordering = ["-id"]
    export_columns = (
        ("id", lambda a: a.id),
        ("created_at", lambda a: a.created_at.isoformat()),
        ("action", lambda a: a.action),
        ("actor", lambda a: a.actor),
        ("channel", lambda a: a.channel),
        ("ip_address", lambda a: a.ip_address),
        ("user_agent", lambda a: a.user_agent),
        ("object_type", lambda a: a.object_type),
        ("object_id", lambda a: a.object_id),
        ("before", lambda a: a.before),
        ("after", lambda a: a.after),
        ("payload_digest", lambda a: a.payload_digest),
        ("prev_hash", lambda a: a.prev_hash),
        ("hash", lambda a: a.hash),
    )

    def get_search_results(self, request, queryset, search_term):
        term = search_term.strip()
        if not term:
            return queryset, False
        condition = Q(actor=term) | Q(object_id=term) | Q(action=term)
        # a username finds that person's entries whether they acted or were acted on
        condition |= Q(actor=f"user:{term}")
        try:
            forms.GenericIPAddressField().clean(term)
        except forms.ValidationError:
            pass
        else:
            condition |= Q(ip_address=term)
        return queryset.filter(condition), False


# --- API tokens -------------------------------------------------------------------------------


class ApiTokenAddForm(forms.ModelForm):
    webhook_url = forms.URLField(required=False, assume_scheme="https")

    class Meta:
        model = ApiToken
        fields = ["name", "principal", "expires_at", "webhook_url"]

    def clean_principal(self):
        principal = self.cleaned_data["principal"]
        if not principal.is_active:
            raise forms.ValidationError("the principal must be an active user")
        return principal

    def clean_expires_at(self):
        expires_at = self.cleaned_data.get("expires_at")
        if expires_at is not None and expires_at <= timezone.now():
            raise forms.ValidationError("the expiry must be in the future")
        return expires_at


@admin.action(description="Revoke selected tokens", permissions=["revoke"])
def revoke_tokens(modeladmin, request, queryset):
    actor = Actor.for_user(request.user, "admin")
    done = 0
    for token_id in queryset.values_list("id", flat=True):
        try:
            with transaction.atomic():  # see terminate_runs
                api_token_revoke(token_id=token_id, actor=actor, request=request)
            done += 1
        except (InvalidState, PermissionDenied) as exc:
            modeladmin.message_user(request, str(exc), messages.WARNING)
    if done:
        modeladmin.message_user(request, f"{done} token(s) revoked.", messages.SUCCESS)


@admin.register(ApiToken)
class ApiTokenAdmin(AuditAdmin):
    """Tokens are created through ``api_token_create`` (the raw token is shown once, on the
    page after adding, and never stored) and otherwise only revoked; both are audited."""

    list_display = [
        "name",
        "prefix",
        "principal",
        "created_by",
        "created_at",
        "expires_at",
        "revoked_at",
        "last_used_at",
    ]
    list_select_related = ["principal"]
    list_filter = ["revoked_at"]
    exact_search_fields = ("name", "prefix", "principal__username")
    actions = [revoke_tokens]
    readonly_fields = [*list_display, "webhook_url"]

    def get_fields(self, request, obj=None):
        if obj is None:
            return ApiTokenAddForm.Meta.fields
        return self.readonly_fields

    def get_readonly_fields(self, request, obj=None):
        return [] if obj is None else self.readonly_fields

    def get_form(self, request, obj=None, **kwargs):
        if obj is None:
            kwargs["form"] = ApiTokenAddForm
        return super().get_form(request, obj, **kwargs)

    def has_change_permission(self, request, obj=None):
        return False

    def has_delete_permission(self, request, obj=None):
        return False

    def has_revoke_permission(self, request: HttpRequest) -> bool:
        return request.user.has_perm("runs.change_apitoken")

    def get_actions(self, request):
        actions = super().get_actions(request)
        actions.pop("delete_selected", None)
        return actions

    def save_model(self, request, obj, form, change):
        try:
            token, raw = api_token_create(
                name=obj.name,
                principal=obj.principal,
                actor=Actor.for_user(request.user, "admin"),
                expires_at=obj.expires_at,
                webhook_url=obj.webhook_url,
                request=request,
            )
        except (InvalidInput, PermissionDenied) as exc:
            raise forms.ValidationError(str(exc)) from None
        # the admin goes on to log the addition and redirect using obj
        obj.pk = token.pk
        obj._state.adding = False
        obj._state.db = token._state.db
        request._api_token_created = (token, raw)

    def response_add(self, request, obj, post_url_continue=None):
        token, raw = request._api_token_created
        # rendered once, straight into the response: the raw token never goes through
        # message storage (a cookie) or the database
        return TemplateResponse(
            request,
            "admin/runs/apitoken/created.html",
            {
                **self.admin_site.each_context(request),
                "opts": self.model._meta,
                "title": f"Token {token.name} created",
                "token": token,
                "raw_token": raw,
            },
        )


# --- users and groups: role changes are audited -----------------------------------------------
# The admin saves users and groups itself (inside its own transaction); these wrappers take a
# snapshot before and after and append one audit entry in that same transaction, so the change
# and its record commit together.


def _admin_actor(request: HttpRequest) -> str:
    return Actor.for_user(request.user, "admin").label


User = get_user_model()


class AuditedUserAdmin(UserAdmin):
    def save_model(self, request, obj, form, change):
        stored = User.objects.get(pk=obj.pk) if change else None
        request._audit_user_before = user_roles_snapshot(stored) if change else {}
        request._audit_email_before = stored.email if change else None
        super().save_model(request, obj, form, change)

    def save_related(self, request, form, formsets, change):
        super().save_related(request, form, formsets, change)
        user = form.instance
        before_email = getattr(request, "_audit_email_before", None)
        if change and before_email != user.email:
            # approval and question links go to this address: whoever changes it can read them
            audit_record(
                action="user.email_changed",
                actor=_admin_actor(request),
                channel="admin",
                request=request,
                object_type="user",
                object_id=user.pk,
                before={"username": user.get_username(), "email": before_email},
                after={"username": user.get_username(), "email": user.email},
            )
        before = getattr(request, "_audit_user_before", {})
        after = user_roles_snapshot(user)
        if change and before == after:
            return  # a name or email edit: not a change of roles
        audit_record(
            action="user.roles_changed" if change else "user.created",
            actor=_admin_actor(request),
            channel="admin",
            request=request,
            object_type="user",
            object_id=user.pk,
            before=before or None,
            after=after,
        )

    def delete_model(self, request, obj):
        before = user_roles_snapshot(obj)
        audit_record(
            action="user.deleted",
            actor=_admin_actor(request),
            channel="admin",
            request=request,
            object_type="user",
            object_id=obj.pk,
            before=before,
        )
        super().delete_model(request, obj)

    def delete_queryset(self, request, queryset):
        for user in queryset:
            self.delete_model(request, user)

    def user_change_password(self, request, id, form_url=""):
        # one transaction: the new password and its audit entry commit together
        with transaction.atomic():
            response = super().user_change_password(request, id, form_url)
            if request.method == "POST" and response.status_code == 302:
                audit_record(
                    action="user.password_changed",
                    actor=_admin_actor(request),
                    channel="admin",
                    request=request,
                    object_type="user",
                    object_id=id,
                )
        return response


class AuditedGroupAdmin(GroupAdmin):
    def save_model(self, request, obj, form, change):
        before = group_snapshot(Group.objects.get(pk=obj.pk)) if change else {}
        request._audit_group_before = before
        super().save_model(request, obj, form, change)

    def save_related(self, request, form, formsets, change):
        super().save_related(request, form, formsets, change)
        group = form.instance
        before = getattr(request, "_audit_group_before", {})
        after = group_snapshot(group)
        if change and before == after:
            return
        audit_record(
            action="group.permissions_changed" if change else "group.created",
            actor=_admin_actor(request),
            channel="admin",
            request=request,
            object_type="group",
            object_id=group.pk,
            before=before or None,
            after=after,
        )

    def delete_model(self, request, obj):
        audit_record(
            action="group.deleted",
            actor=_admin_actor(request),
            channel="admin",
            request=request,
            object_type="group",
            object_id=obj.pk,
            before=group_snapshot(obj),
        )
        super().delete_model(request, obj)

    def delete_queryset(self, request, queryset):
        for group in queryset:
            self.delete_model(request, group)


for _model, _admin_class in ((User, AuditedUserAdmin), (Group, AuditedGroupAdmin)):
    if admin.site.is_registered(_model):
        admin.site.unregister(_model)
    admin.site.register(_model, _admin_class)


# --- sign-in lockouts (django-axes) -------------------------------------------------------------


@admin.register(AccessAttempt)
class SignInLockoutAdmin(admin.ModelAdmin):
    """Failed sign-ins per username and address, as django-axes counts them. Deleting rows
    is the unlock: each lifted lockout is an ``auth.unlocked`` audit entry naming who."""

    list_display = ("username", "ip_address", "failures_since_start", "attempt_time", "locked")
    list_filter = ("attempt_time",)
    search_fields = ("=username", "=ip_address")
    ordering = ("-attempt_time",)
    fields = ("username", "ip_address", "user_agent", "failures_since_start", "attempt_time")
    readonly_fields = fields

    @admin.display(boolean=True, description="locked out")
    def locked(self, obj: AccessAttempt) -> bool:
        from django.conf import settings

        return obj.failures_since_start >= settings.AXES_FAILURE_LIMIT and (
            obj.attempt_time >= timezone.now() - settings.AXES_COOLOFF_TIME
        )

    def has_add_permission(self, request, obj=None):
        return False

    def has_change_permission(self, request, obj=None):
        return False

    def delete_model(self, request, obj):
        with transaction.atomic(), unlocking_as(_admin_actor(request), "admin", request):
            super().delete_model(request, obj)

    def delete_queryset(self, request, queryset):
        with transaction.atomic(), unlocking_as(_admin_actor(request), "admin", request):
            super().delete_queryset(request, queryset)


# --- django-q2 ------------------------------------------------------------------------------------
# Its admin lets a superuser add a Schedule whose ``func`` names any importable callable, which
# the workers then run: code execution from a web form, against "read-only for everyone,
# superusers included". Queued tasks and results are the engine's plumbing, not the record.
# Schedules are made in code or a shell (docs/operations.md).
for _q_model in (Schedule, Success, Failure, OrmQ):
    if admin.site.is_registered(_q_model):
        admin.site.unregister(_q_model)


# spend caps' tables, read-only for auditors (runs/admin_spend.py)
from runs import admin_spend  # noqa: E402,F401

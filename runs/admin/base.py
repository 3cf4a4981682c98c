"""Building blocks of the auditors' admin: the read-only base (``AuditAdmin``, ``ReadOnlyAdmin``:
exact-match search on the indexes, masking, bucket probes for date drill-down), the capped
paginator, and the link to a run."""

from __future__ import annotations

import re
import uuid
from collections.abc import Callable
from datetime import datetime, time, timedelta
from typing import Any

from django.contrib import admin
from django.contrib.admin.options import IncorrectLookupParameters
from django.core.exceptions import PermissionDenied as DjangoPermissionDenied
from django.core.paginator import Paginator
from django.db.models import Max, Min, Q, QuerySet
from django.http import HttpRequest, HttpResponse, StreamingHttpResponse
from django.urls import path, reverse
from django.utils import timezone
from django.utils.functional import cached_property
from django.utils.html import format_html

from runs.audit.export import csv_lines, keyset_iterate
from runs.masking import UNMASKED, Masker, masked_rows, maskers_for_ids


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


def as_uuid(term: str) -> uuid.UUID | None:
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
        term_uuid = as_uuid(term)
        if term_uuid is not None:
            lookups = [(field_path, term_uuid) for field_path in self.uuid_search_fields]
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

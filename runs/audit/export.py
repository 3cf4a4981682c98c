"""Streaming exports of the record (``audit_export``, the admin's CSV downloads): keyset
iteration over any table, events as rows, CSV and JSON lines."""

from __future__ import annotations

import csv
import json
from collections.abc import Iterable, Iterator
from datetime import datetime
from typing import Any

from django.db.models import F, Q, QuerySet

from runs.models import RunEvent

EXPORT_CHUNK_SIZE = 2000


def keyset_iterate(
    queryset: QuerySet, *, keys: tuple[str, ...] = ("id",), chunk_size: int = 0
) -> Iterator[Any]:
    """Every row of ``queryset`` in ``keys`` order, fetched ``chunk_size`` rows per query.

    Keyset pagination (``WHERE id > last seen ORDER BY id LIMIT n``) rather than a server-side
    cursor: memory stays constant whatever the range, each query is short (no transaction or
    snapshot held open for the length of a download), and it works the same on SQLite and
    behind a transaction-pooling proxy where named cursors do not. The primary key is the
    default key: ids are allocated in the order rows were written (for audit entries, the
    chain's order), and its index serves every chunk, whatever else the filter says."""
    chunk_size = chunk_size or EXPORT_CHUNK_SIZE
    queryset = queryset.order_by(*keys)
    last: tuple[Any, ...] | None = None
    while True:
        page = queryset
        if last is not None:
            page = page.filter(_after(keys, last))
        rows = list(page[:chunk_size])
        yield from rows
        if len(rows) < chunk_size:
            return
        last = tuple(_key(rows[-1], key) for key in keys)


def _key(row: Any, key: str) -> Any:
    # model instances, or dicts from ``.values()`` (several times faster for big exports)
    return row[key] if isinstance(row, dict) else getattr(row, key)


def _after(keys: tuple[str, ...], last: tuple[Any, ...]) -> Q:
    # (a, b) > (x, y)  ==  a > x OR (a = x AND b > y)
    condition = Q(**{f"{keys[-1]}__gt": last[-1]})
    for index in range(len(keys) - 2, -1, -1):
        condition = Q(**{f"{keys[index]}__gt": last[index]}) | (
            Q(**{keys[index]: last[index]}) & condition
        )
    return condition


EVENT_COLUMNS = [
    "run_id",
    "seq",
    "created_at",
    "type",
    "actor",
    "channel",
    "incarnation",
    "trace_id",
    "span_id",
    "payload",
    "payload_digest",
    "prev_hash",
    "hash",
    # whether the event's run is a dry run (issue 23): its tools were only simulated. Not
    # part of the chain (the run's run.created event records it, and is chained)
    "dry_run",
]


EVENT_FIELDS = ["id", *EVENT_COLUMNS[:-1]]


def event_row(event: dict[str, Any]) -> dict[str, Any]:
    """One exported event from a ``.values(*EVENT_FIELDS)`` row."""
    row = {column: event[column] for column in EVENT_COLUMNS}
    row["run_id"] = str(row["run_id"])
    row["created_at"] = row["created_at"].isoformat()
    return row


def events_for_export(
    *,
    since: datetime | None = None,
    until: datetime | None = None,
    run_id: Any = None,
    types: Iterable[str] = (),
) -> QuerySet:
    """Events with ``since <= created_at < until`` (either bound optional), optionally of one
    run and some types, as ``.values()`` rows for ``event_row``. Payloads were masked at
    write time, so an export holds no secret."""
    events = RunEvent.objects.all()
    if since is not None:
        events = events.filter(created_at__gte=since)
    if until is not None:
        events = events.filter(created_at__lt=until)
    if run_id is not None:
        events = events.filter(run_id=run_id)
    types = list(types)
    if types:
        events = events.filter(type__in=types)
    return events.values(*EVENT_FIELDS, dry_run=F("run__dry_run"))


class _Echo:
    """A file-like object whose write() returns the line: csv.writer then yields strings."""

    def write(self, value: str) -> str:
        return value


def csv_lines(columns: list[str], rows: Iterable[dict[str, Any]]) -> Iterator[str]:
    writer = csv.writer(_Echo())
    yield writer.writerow(columns)
    for row in rows:
        yield writer.writerow([_cell(row[column]) for column in columns])


def jsonl_lines(rows: Iterable[dict[str, Any]]) -> Iterator[str]:
    for row in rows:
        yield json.dumps(row, sort_keys=True, default=str) + "\n"


def _cell(value: Any) -> Any:
    if value is None:
        return ""
    if isinstance(value, dict | list):
        return json.dumps(value, sort_keys=True, default=str)
    text = str(value)
    # a spreadsheet would run a cell starting with these as a formula (CSV injection)
    if text[:1] in ("=", "+", "-", "@", "\t", "\r") and not _is_number(text):
        return "'" + text
    return text


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True

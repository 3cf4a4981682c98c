"""The run events' monthly partitions (PostgreSQL; runs 0031, docs/operations.md "Retention").

``runs_runevent`` is partitioned by its runs' creation month (``run_created_at``, UTC): one
partition per month (``runs_runevent_YYYY_MM``) and a ``DEFAULT`` one that catches an event
of a month nobody created a partition for, so an insert never fails. Only the tables' owner
creates, detaches and drops partitions; the application's role owns nothing and cannot
(docs/operations.md, "Running as a least-privileged database role").
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import UTC, date

from django.db import connection, transaction

from runs.errors import InvalidState, PermissionDenied
from runs.models import RunEvent

EVENTS = RunEvent._meta.db_table
DEFAULT = f"{EVENTS}_default"
_MONTHLY = re.compile(rf"{EVENTS}_(\d{{4}})_(\d{{2}})")


@dataclass(frozen=True)
class Partition:
    name: str
    month: date | None  # None: the DEFAULT partition


def partition_name(month: date) -> str:
    return f"{EVENTS}_{month:%Y_%m}"


def partitioned() -> bool:
    """Whether the events are partitioned here: on PostgreSQL, after runs 0031."""
    if connection.vendor != "postgresql":
        return False
    with connection.cursor() as cursor:
        cursor.execute("SELECT relkind = 'p' FROM pg_class WHERE oid = to_regclass(%s)", [EVENTS])
        row = cursor.fetchone()
    return bool(row and row[0])


def partitions() -> list[Partition]:
    """The events' partitions as PostgreSQL lists them (``pg_inherits``), by name."""
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT c.relname FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid "
            "WHERE i.inhparent = %s::regclass ORDER BY c.relname",
            [EVENTS],
        )
        names = [name for (name,) in cursor.fetchall()]
    found = []
    for name in names:
        match = _MONTHLY.fullmatch(name)
        month = date(int(match.group(1)), int(match.group(2)), 1) if match else None
        found.append(Partition(name=name, month=month))
    return found


def require_owner(doing: str) -> None:
    """Creating, detaching and dropping partitions needs the events table's owner."""
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT pg_has_role(current_user, relowner, 'USAGE'), current_user "
            "FROM pg_class WHERE oid = %s::regclass",
            [EVENTS],
        )
        owner, role = cursor.fetchone()
    if not owner:
        raise PermissionDenied(
            f"role {role} may not {doing}: connect as the tables' owner (the role migrations "
            "run as), not the application's role"
        )


def months_in_default() -> list[date]:
    """The months whose events sit in the DEFAULT partition (no partition of their own when
    they were written): normally none."""
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT DISTINCT date_trunc('month', run_created_at AT TIME ZONE 'UTC')::date "
            f"FROM {connection.ops.quote_name(DEFAULT)} ORDER BY 1"
        )
        return [month for (month,) in cursor.fetchall()]


def ensure_partition(month: date) -> str:
    """The month's partition, created if missing (moving the month's events out of the
    DEFAULT partition when they are there: the parent is locked until the transaction
    ends). Call inside a transaction, as the owner."""
    with connection.cursor() as cursor:
        cursor.execute("SELECT agentops_event_partition(%s)", [month])
        return cursor.fetchone()[0]


def create_ahead(months_ahead: int) -> list[str]:
    """Partitions for this month and the next ``months_ahead`` (database time, UTC), and
    for every month found in the DEFAULT partition; returns the ones created."""
    if not partitioned():
        raise InvalidState("partitions are for PostgreSQL (after runs 0031)")
    require_owner("create partitions")
    with connection.cursor() as cursor:
        cursor.execute("SELECT now()")
        now = cursor.fetchone()[0].astimezone(UTC)
    months = []
    for ahead in range(months_ahead + 1):
        index = now.month - 1 + ahead
        months.append(date(now.year + index // 12, index % 12 + 1, 1))
    existing = {partition.name for partition in partitions()}
    created = []
    with transaction.atomic():
        for month in sorted({*months, *months_in_default()}):
            if partition_name(month) not in existing:
                created.append(ensure_partition(month))
    return created

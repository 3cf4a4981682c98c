"""Database time: leases and expiry compare against the database's clock, never a host's."""

from __future__ import annotations

from datetime import UTC, datetime

from django.db import connection


def db_now() -> datetime:
    with connection.cursor() as cursor:
        if connection.vendor == "sqlite":
            # the same clock and format Django's Now() uses on SQLite
            cursor.execute("SELECT STRFTIME('%Y-%m-%d %H:%M:%f', 'NOW')")
            (value,) = cursor.fetchone()
            return datetime.fromisoformat(value).replace(tzinfo=UTC)
        cursor.execute("SELECT STATEMENT_TIMESTAMP()")
        (value,) = cursor.fetchone()
        return value

"""The dedicated benchmark database: created, migrated, used, dropped.

The benchmark never writes to the database ``DATABASE_URL`` names: it creates
``<name>_bench`` beside it on the same server (so the same PostgreSQL, disk and settings),
points this process's connection and its worker processes at it, and drops it at the end.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any
from urllib.parse import quote

import psycopg
from django.conf import settings
from django.core.management import call_command
from django.db import connection, connections
from psycopg import sql


class NotPostgres(Exception):
    pass


def require_postgres() -> None:
    if connection.vendor != "postgresql":
        raise NotPostgres(
            "bench needs PostgreSQL: set DATABASE_URL=postgres://USER@HOST:PORT/NAME "
            f"(this is {connection.vendor}; its numbers would say nothing about production)"
        )


def _conninfo(settings_dict: dict[str, Any], dbname: str) -> dict[str, Any]:
    info = {
        "dbname": dbname,
        "user": settings_dict.get("USER") or None,
        "password": settings_dict.get("PASSWORD") or None,
        "host": settings_dict.get("HOST") or None,
        "port": settings_dict.get("PORT") or None,
    }
    return {key: value for key, value in info.items() if value is not None}


def admin_connect(settings_dict: dict[str, Any]) -> psycopg.Connection:
    # the maintenance database: CREATE/DROP DATABASE cannot run inside the target
    return psycopg.connect(**_conninfo(settings_dict, "postgres"), autocommit=True)


def database_url(settings_dict: dict[str, Any]) -> str:
    user = quote(settings_dict.get("USER") or "", safe="")
    password = settings_dict.get("PASSWORD") or ""
    auth = f"{user}:{quote(password, safe='')}@" if password else (f"{user}@" if user else "")
    host = settings_dict.get("HOST") or "127.0.0.1"
    port = settings_dict.get("PORT") or 5432
    return f"postgres://{auth}{host}:{port}/{quote(settings_dict['NAME'], safe='')}"


def conninfo(settings_dict: dict[str, Any]) -> dict[str, Any]:
    return _conninfo(settings_dict, settings_dict["NAME"])


def _drop(admin: psycopg.Connection, name: str) -> None:
    # FORCE: a worker killed by the recovery measurement may leave a backend behind
    admin.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name)))


@contextmanager
def bench_database(*, keep: bool = False) -> Iterator[str]:
    """Create ``<name>_bench``, switch the default connection to it, migrate; yield its name.
    Dropped (and the connection switched back) at the end unless ``keep``."""
    require_postgres()
    settings_dict = connections["default"].settings_dict
    original = settings_dict["NAME"]
    name = f"{original}_bench"[:63]
    connection.close()
    with admin_connect(settings_dict) as admin:
        _drop(admin, name)
        admin.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    # the same dict object backs settings.DATABASES and the connection (as Django's own
    # test-database setup does it)
    settings.DATABASES["default"]["NAME"] = name
    settings_dict["NAME"] = name
    try:
        call_command("migrate", verbosity=0, interactive=False)
        yield name
    finally:
        connections.close_all()
        settings.DATABASES["default"]["NAME"] = original
        settings_dict["NAME"] = original
        if not keep:
            with admin_connect(settings_dict) as admin:
                _drop(admin, name)


def xact_commits(settings_dict: dict[str, Any]) -> int:
    """Transactions committed in the bench database, from PostgreSQL's own counters (read
    from the maintenance database, so reading does not count itself)."""
    with admin_connect(settings_dict) as admin:
        row = admin.execute(
            "SELECT xact_commit FROM pg_stat_database WHERE datname = %s",
            [settings_dict["NAME"]],
        ).fetchone()
    return int(row[0]) if row else 0

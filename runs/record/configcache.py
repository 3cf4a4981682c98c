"""What the operators configured, kept in each process and read again only when it changed.

Deciding a call must cost no query of its own (docs/benchmarks.md: one statement per read
step), yet it depends on rows people change at any time: the operators' tool limits
(``runs.flow``), the spend caps (``runs.spend``), which tools have a published data policy
(``approvals.gate``) and a principal's name and groups (``runs.gate``). Each registers here
with the SQL of its *generation*, a value that changes in the same commit as the
configuration, and how to read the configuration.

The claim statement (``runs.record.postgres/orm.take_lease``) and a remote agent's lease check
(``runs.remote.lease._held``) return every generation as one value (``generation_sql``):
``note`` compares each with what this process last saw and forgets the configurations that
moved; the next use reads them again (``Config.get``). So a change committed anywhere is
seen by the next claim everywhere — no interval, and no query while nothing changes. A slice
that runs on reads them again between its steps once ``SLICE_MAX_AGE_SECONDS`` have passed
since they were last read (``refresh_if_older``: one query a second at most, none for a short
slice), so a new policy reaches a long slice within a second. Paths with no claim before them
read the generations in a statement of their own (``refresh``).
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable
from typing import Any, Generic, TypeVar

from django.db import connection

from runs.models import ConfigGeneration

T = TypeVar("T")

# between the generations in the one value the claim returns (no generation contains it)
SEPARATOR = "|"

# how old the generations a running slice decides by may grow before it reads them again
SLICE_MAX_AGE_SECONDS = 1.0


class Config(Generic[T]):
    """One configuration: ``get()`` is what this process read of it since its generation
    last moved (read then, at its first use)."""

    _UNREAD: Any = object()

    def __init__(
        self, name: str, *, generation_sql: dict[str, str], read: Callable[[str | None], T]
    ) -> None:
        self.name = name
        self.generation_sql = generation_sql
        # given the generation this process last saw (None: not seen yet), so that a
        # generation that says "no rows" can spare the query
        self._read = read
        self._lock = threading.Lock()
        self._generation: str | None = None
        self._value: Any = self._UNREAD

    def get(self) -> T:
        value = self._value
        if value is self._UNREAD:
            with self._lock:
                value = self._value
                if value is self._UNREAD:
                    value = self._value = self._read(self._generation)
        return value

    def forget(self) -> None:
        """This process changed it: read it again at its next use (called at the commit)."""
        with self._lock:
            self._value = self._UNREAD

    def note(self, generation: str) -> None:
        if generation == self._generation:
            return
        with self._lock:
            self._generation = generation
            self._value = self._UNREAD


_configs: list[Config[Any]] = []


def rows_generation_sql(table: str) -> dict[str, str]:
    """The generation of a table of settings whose rows carry ``updated_at`` (``auto_now``):
    how many rows, and the latest change — an added, changed or removed row moves it."""
    return {
        "postgresql": (
            f"SELECT count(*)::text || ':' || coalesce(max(updated_at)::text, '') FROM {table}"
        ),
        "sqlite": f"SELECT count(*) || ':' || coalesce(max(updated_at), '') FROM {table}",
    }


def token_generation_sql(name: str) -> dict[str, str]:
    """The generation a database trigger sets (``runs.models.ConfigGeneration``): for
    configurations changed by more hands than this project's services (the Django admin,
    ``user.groups.add()``, raw SQL), whose tables have no ``updated_at`` to read."""
    sql = f"SELECT token FROM {ConfigGeneration._meta.db_table} WHERE name = '{name}'"
    return {"postgresql": sql, "sqlite": sql}


def register(
    name: str, *, generation_sql: dict[str, str], read: Callable[[str | None], T]
) -> Config[T]:
    """A configuration whose generation every claim carries. Registered at import, before
    the first claim (the apps' modules are imported when Django starts)."""
    config = Config(name, generation_sql=generation_sql, read=read)
    _configs.append(config)
    _joined_sql.clear()
    return config


_joined_sql: dict[str, str] = {}


def generation_sql(vendor: str) -> str:
    """One SQL expression: every registered generation, as text, joined by ``SEPARATOR``."""
    if vendor not in _joined_sql:
        _joined_sql[vendor] = (
            f" || '{SEPARATOR}' || ".join(
                f"coalesce(({config.generation_sql[vendor]}), '')" for config in _configs
            )
            or "''"
        )
    return _joined_sql[vendor]


def note(generation: str | None) -> None:
    """A statement returned ``generation_sql``: forget what moved. No query."""
    global _noted_at
    if generation is None:
        return
    for config, part in zip(_configs, generation.split(SEPARATOR), strict=False):
        config.note(part)
    _noted_at = time.monotonic()


_noted_at = 0.0


def refresh_if_older(seconds: float = SLICE_MAX_AGE_SECONDS) -> None:
    """Between the steps of a slice: read the generations again if the last read is older
    than ``seconds`` (one query), else nothing."""
    if time.monotonic() - _noted_at > seconds:
        refresh()


def refresh() -> None:
    """Read the generations now (one query): for paths that have no claim to carry them."""
    with connection.cursor() as cursor:
        cursor.execute("SELECT " + generation_sql(connection.vendor))
        note(cursor.fetchone()[0])


def forget_all() -> None:
    """As a new process: nothing read yet (the test suite, between tests)."""
    for config in _configs:
        with config._lock:
            config._generation = None
            config._value = Config._UNREAD


# --- the triggers that move a token generation (migrations runs.0030, approvals.0015) --------

_PG_FUNCTION = """
CREATE OR REPLACE FUNCTION agentops_config_changed() RETURNS trigger AS $$
BEGIN
    INSERT INTO {table} (name, token) VALUES (TG_ARGV[0], gen_random_uuid()::text)
        ON CONFLICT (name) DO UPDATE SET token = EXCLUDED.token;
    RETURN NULL;
END
$$ LANGUAGE plpgsql;
"""


def token_trigger_sql(
    vendor: str, *, name: str, table: str, events: list[tuple[str, tuple[str, ...]]]
) -> tuple[list[str], list[str]]:
    """SQL creating (and dropping) row triggers on ``table`` that give generation ``name`` a
    new token on each of ``events``: ("INSERT", ()), ("DELETE", ()), or ("UPDATE", columns),
    an update that changes one of ``columns`` (every update with none)."""
    tokens = ConfigGeneration._meta.db_table
    create: list[str] = []
    drop: list[str] = []
    if vendor == "postgresql":
        create.append(_PG_FUNCTION.format(table=tokens))
    for event, columns in events:
        trigger = f"{table}_{name}_{event.lower()}"
        on = f"{event} OF {', '.join(columns)}" if columns else event
        differs = " IS DISTINCT FROM " if vendor == "postgresql" else " IS NOT "
        when = (
            f"WHEN ({' OR '.join(f'OLD.{c}{differs}NEW.{c}' for c in columns)}) " if columns else ""
        )
        if vendor == "postgresql":
            drop.append(f"DROP TRIGGER IF EXISTS {trigger} ON {table}")
            create += [
                drop[-1],
                f"CREATE TRIGGER {trigger} AFTER {on} ON {table} FOR EACH ROW {when}"
                f"EXECUTE FUNCTION agentops_config_changed('{name}')",
            ]
        else:
            drop.append(f"DROP TRIGGER IF EXISTS {trigger}")
            # no INSERT OR REPLACE: an outer INSERT OR IGNORE (``groups.add()``) would turn it
            # into an ignore, and the token would not move
            create += [
                drop[-1],
                f"CREATE TRIGGER {trigger} AFTER {on} ON {table} FOR EACH ROW {when}BEGIN "
                f"INSERT INTO {tokens} (name, token) SELECT '{name}', '' "
                f"WHERE NOT EXISTS (SELECT 1 FROM {tokens} WHERE name = '{name}'); "
                f"UPDATE {tokens} SET token = lower(hex(randomblob(16))) WHERE name = '{name}'; "
                "END",
            ]
    return create, drop


def token_triggers_install(
    schema_editor: Any, *, name: str, watched: list[tuple[str, list[tuple[str, tuple[str, ...]]]]]
) -> None:
    """In a migration: the triggers of generation ``name`` on each watched table, and a first
    token (the configuration was never read by this token)."""
    vendor = schema_editor.connection.vendor
    for table, events in watched:
        create, _drop = token_trigger_sql(vendor, name=name, table=table, events=events)
        for statement in create:
            schema_editor.execute(statement, params=None)
    schema_editor.execute(
        f"DELETE FROM {ConfigGeneration._meta.db_table} WHERE name = %s", params=[name]
    )
    schema_editor.execute(
        f"INSERT INTO {ConfigGeneration._meta.db_table} (name, token) VALUES (%s, %s)",
        params=[name, uuid.uuid4().hex],
    )


def token_triggers_drop(
    schema_editor: Any, *, name: str, watched: list[tuple[str, list[tuple[str, tuple[str, ...]]]]]
) -> None:
    vendor = schema_editor.connection.vendor
    for table, events in watched:
        _create, drop = token_trigger_sql(vendor, name=name, table=table, events=events)
        for statement in drop:
            schema_editor.execute(statement, params=None)

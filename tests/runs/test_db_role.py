"""The audit trail the application cannot empty (issue 17): TRUNCATE refused on PostgreSQL
whoever sends it, and a least-privileged role that cannot update, delete, truncate or switch
off the append-only triggers."""

from __future__ import annotations

import uuid

import psycopg
import pytest
from django.core.management import CommandError, call_command
from django.db import DatabaseError, connection, transaction

from runs.dbrole import APPEND_ONLY_TABLES, current_app_role_sql

pytestmark = pytest.mark.django_db


def _postgresql_only():
    if connection.vendor != "postgresql":
        pytest.skip("roles and TRUNCATE triggers exist on PostgreSQL only")


def _connect(**overrides) -> psycopg.Connection:
    params = connection.get_connection_params()
    kwargs = {
        "host": params.get("host") or "127.0.0.1",
        "port": params.get("port") or 5432,
        "dbname": connection.settings_dict["NAME"],
        "user": params.get("user"),
        "password": params.get("password"),
        **overrides,
    }
    return psycopg.connect(**{k: v for k, v in kwargs.items() if v is not None})


@pytest.fixture
def app_role():
    """A role made by ``db_app_role``'s SQL, committed (through a connection of its own) so a
    second connection can log in as it; dropped afterwards. Unique per test: roles are shared
    by every database of the server."""
    _postgresql_only()
    role = f"agentops_test_app_{uuid.uuid4().hex[:10]}"
    statements = current_app_role_sql(role)
    with _connect(autocommit=True) as owner:
        for statement in statements:
            owner.execute(statement)
    yield role
    with _connect(autocommit=True) as owner:
        owner.execute(f'DROP OWNED BY "{role}"')
        owner.execute(f'DROP ROLE "{role}"')


def test_postgresql_refuses_truncate_of_the_append_only_tables_even_for_the_owner():
    _postgresql_only()
    for statement in (
        "TRUNCATE runs_auditentry",
        "TRUNCATE runs_runevent",
        # through the runs' foreign keys: the cascade reaches the events and is refused too
        "TRUNCATE runs_run CASCADE",
    ):
        with (
            pytest.raises(DatabaseError, match="append-only"),
            transaction.atomic(),
            connection.cursor() as cursor,
        ):
            cursor.execute(statement)


def test_the_least_privileged_role_can_append_but_not_rewrite_empty_or_unguard(app_role):
    from runs.audit.entries import audit_record

    audit_record(action="token.created", actor="user:root", channel="cli", object_id=1)
    with _connect(user=app_role) as app:
        refused = {}
        with app.transaction(force_rollback=True):
            # what the application does every day works
            assert app.execute("SELECT count(*) FROM runs_auditentry").fetchone() is not None
            app.execute(
                "INSERT INTO runs_auditentry (created_at, action, actor, channel, user_agent, "
                "object_type, object_id, payload_digest, prev_hash, hash) VALUES "
                "(now(), 'x', 'y', 'cli', '', '', '', 'd', 'p', %s)",
                [uuid.uuid4().hex],
            )
            app.execute("UPDATE runs_run SET status = status WHERE false")
            app.execute("DELETE FROM django_q_ormq WHERE false")
            for table in APPEND_ONLY_TABLES:
                for statement in (
                    f"UPDATE {table} SET actor = 'user:mallory'",
                    f"DELETE FROM {table}",
                    f"TRUNCATE {table}",
                    f"ALTER TABLE {table} DISABLE TRIGGER ALL",
                    f"DROP TABLE {table}",
                ):
                    with pytest.raises(psycopg.Error) as caught, app.transaction():
                        app.execute(statement)
                    refused[statement] = caught.value.sqlstate
            with pytest.raises(psycopg.Error), app.transaction():
                app.execute("TRUNCATE runs_run CASCADE")
            # nor may it turn triggers off for its session (superusers only)
            with pytest.raises(psycopg.Error), app.transaction():
                app.execute("SET session_replication_role = replica")
    # 42501 insufficient_privilege: no privilege, or not the owner
    assert set(refused.values()) == {"42501"}, refused
    assert len(refused) == 10


def test_db_app_role_applies_grants_that_leave_no_way_to_rewrite():
    _postgresql_only()
    role = f"agentops_test_app_{uuid.uuid4().hex[:10]}"
    # CREATE ROLE is transactional: rolled back with the test
    call_command("db_app_role", role, apply=True)
    with connection.cursor() as cursor:
        for table, privilege, expected in [
            ("runs_auditentry", "INSERT", True),
            ("runs_auditentry", "SELECT", True),
            ("runs_auditentry", "UPDATE", False),
            ("runs_auditentry", "DELETE", False),
            ("runs_auditentry", "TRUNCATE", False),
            ("runs_runevent", "UPDATE", False),
            ("runs_runevent", "TRUNCATE", False),
            ("runs_run", "UPDATE", True),
            ("runs_run", "TRUNCATE", False),
            ("django_migrations", "INSERT", False),
        ]:
            cursor.execute("SELECT has_table_privilege(%s, %s, %s)", [role, table, privilege])
            assert cursor.fetchone()[0] is expected, (table, privilege)
        cursor.execute(
            "SELECT rolsuper, rolcreaterole, rolinherit FROM pg_roles WHERE rolname = %s", [role]
        )
        assert cursor.fetchone() == (False, False, False)


def test_db_app_role_prints_the_sql_and_refuses_the_owner(capsys):
    _postgresql_only()
    call_command("db_app_role", "agentops_app")
    out = capsys.readouterr().out
    assert 'GRANT SELECT, INSERT ON "runs_auditentry", "runs_runevent" TO "agentops_app";' in out
    assert "TRUNCATE" not in out
    with pytest.raises(CommandError, match="the owner"):
        call_command("db_app_role", connection.get_connection_params()["user"])


def test_db_app_role_is_for_postgresql_only():
    if connection.vendor == "postgresql":
        pytest.skip("SQLite only")
    with pytest.raises(CommandError, match="PostgreSQL"):
        call_command("db_app_role", "agentops_app")

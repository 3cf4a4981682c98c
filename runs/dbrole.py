"""The least-privileged PostgreSQL role the application runs as (issue 17, docs/operations.md).

The role that owns the tables can disable their append-only triggers, truncate them, alter or
drop them: a compromised application connected as the owner could empty the audit trail in
two statements. Connected as a role that owns nothing and holds only the DML it needs, it
cannot: ``ALTER TABLE … DISABLE TRIGGER`` needs ownership, ``TRUNCATE`` needs the TRUNCATE
privilege, and on the append-only tables it holds only SELECT and INSERT. Migrations keep
running as the owner.
"""

from __future__ import annotations

from django.db import connection

from runs.models import AuditEntry, RunEvent

# read and appended, never changed: SELECT and INSERT only
APPEND_ONLY_TABLES = (RunEvent._meta.db_table, AuditEntry._meta.db_table)
# the application reads which migrations ran (``migrate --check`` in a health check); only the
# owner applies them
READ_ONLY_TABLES = ("django_migrations",)


def quote(name: str) -> str:
    return connection.ops.quote_name(name)


def app_role_sql(role: str, *, tables: list[str], database: str, schema: str) -> list[str]:
    """Statements that create ``role`` (if missing) and set its privileges to exactly what the
    application needs on ``tables``. Idempotent: run again after every ``migrate`` so tables
    added since get their grants (new tables get none until then)."""
    quoted_role = quote(role)
    literal_role = role.replace("'", "''")
    append_only = [t for t in tables if t in APPEND_ONLY_TABLES]
    read_only = [t for t in tables if t in READ_ONLY_TABLES]
    read_write = [t for t in tables if t not in APPEND_ONLY_TABLES and t not in READ_ONLY_TABLES]
    # NOINHERIT: should anyone later grant it membership in the owner's role, it still does
    # not act with the owner's rights without an explicit SET ROLE
    attributes = "LOGIN NOSUPERUSER NOCREATEDB NOCREATEROLE NOREPLICATION NOBYPASSRLS NOINHERIT"
    statements = [
        "DO $$ BEGIN "
        f"IF NOT EXISTS (SELECT FROM pg_roles WHERE rolname = '{literal_role}') THEN "
        f"CREATE ROLE {quoted_role} {attributes}; END IF; END $$",
        f"ALTER ROLE {quoted_role} {attributes}",
        f"GRANT CONNECT ON DATABASE {quote(database)} TO {quoted_role}",
        f"GRANT USAGE ON SCHEMA {quote(schema)} TO {quoted_role}",
        # start from nothing, so a privilege granted by hand earlier does not linger
        f"REVOKE ALL ON ALL TABLES IN SCHEMA {quote(schema)} FROM {quoted_role}",
        f"REVOKE ALL ON ALL SEQUENCES IN SCHEMA {quote(schema)} FROM {quoted_role}",
    ]
    if read_write:
        statements.append(
            f"GRANT SELECT, INSERT, UPDATE, DELETE ON {_list(read_write)} TO {quoted_role}"
        )
    if append_only:
        statements.append(f"GRANT SELECT, INSERT ON {_list(append_only)} TO {quoted_role}")
    if read_only:
        statements.append(f"GRANT SELECT ON {_list(read_only)} TO {quoted_role}")
    # nextval() of the id sequences (identity columns need no grant; serial ones do)
    statements.append(f"GRANT USAGE ON ALL SEQUENCES IN SCHEMA {quote(schema)} TO {quoted_role}")
    return statements


def _list(tables: list[str]) -> str:
    return ", ".join(quote(table) for table in sorted(tables))


def current_app_role_sql(role: str) -> list[str]:
    """``app_role_sql`` for the tables of the database this process is connected to."""
    with connection.cursor() as cursor:
        cursor.execute("SELECT current_database(), current_schema()")
        database, schema = cursor.fetchone()
    tables = connection.introspection.table_names()
    return app_role_sql(role, tables=tables, database=database, schema=schema)


def role_owns_nothing(role: str) -> bool:
    """Whether ``role`` owns no table, sequence or view in this database (owning one would
    let it disable triggers or truncate)."""
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT count(*) FROM pg_class c JOIN pg_roles r ON r.oid = c.relowner "
            "WHERE r.rolname = %s",
            [role],
        )
        return cursor.fetchone()[0] == 0

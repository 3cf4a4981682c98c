"""Issue 24 item 4: run events partitioned by their run's creation month.

Every event carries its run's creation time (``run_created_at``, copied at insert). On
PostgreSQL ``runs_runevent`` becomes ``PARTITION BY RANGE (run_created_at)``: a partition per
month (``runs_runevent_YYYY_MM``, UTC) from the oldest run to three months ahead, and a
``DEFAULT`` partition (``runs_runevent_default``) that catches an event of a month without a
partition, so an insert never fails. Retention then detaches and drops a month as one table:
no row deleted, no chain rewritten (docs/operations.md, "Retention").

The table is built anew and the events copied under the migration's lock (one transaction:
the old table's indexes and sequence renamed away, the new one created with their names, the
events copied with their run's time, the old table dropped). PostgreSQL requires the partition
key in every unique key: the primary key is ``(id, run_created_at)`` and ``event_run_seq_uniq``
``(run_id, seq, run_created_at)`` — the same rules, as a run has one creation time. The foreign
key to the runs and the other indexes are recreated as they were; the append-only trigger
(on the parent: cloned to every partition) and the TRUNCATE trigger (statement-level: on the
parent and on each partition, which a TRUNCATE could name directly) too. The append-only
trigger no longer lets an archived event's DELETE through (runs 0028): retention drops whole
partitions, as the owner, and deletes no row.

``agentops_event_partition(month)`` creates a month's partition (``retention --create-ahead``
calls it, as the owner); when the DEFAULT partition already holds events of that month it
moves them into the new partition in the same transaction.

Roles keep the privileges they held on the old table (the application's role: SELECT and
INSERT); the partitions get none, so the application reaches them only through the parent.

On SQLite the column is filled from the runs and the table stays as it is.
"""

from datetime import UTC, date, datetime

from django.db import migrations, models

EVENTS = "runs_runevent"
OLD = "runs_runevent_unpartitioned"
MONTHS_AHEAD = 3

PARTITION_FUNCTION = """
CREATE OR REPLACE FUNCTION agentops_event_partition(of_month date) RETURNS text AS $$
DECLARE
    first_day date := date_trunc('month', of_month)::date;
    start_at timestamptz := first_day::timestamp AT TIME ZONE 'UTC';
    end_at timestamptz := (first_day + interval '1 month')::timestamp AT TIME ZONE 'UTC';
    partition_name text := 'runs_runevent_' || to_char(first_day, 'YYYY_MM');
BEGIN
    IF EXISTS (SELECT FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid
               WHERE i.inhparent = 'runs_runevent'::regclass
                 AND c.relname = partition_name) THEN
        RETURN partition_name;
    END IF;
    IF NOT EXISTS (SELECT FROM runs_runevent_default
                   WHERE run_created_at >= start_at AND run_created_at < end_at) THEN
        EXECUTE format('CREATE TABLE %I PARTITION OF runs_runevent FOR VALUES FROM (%L) TO (%L)',
                       partition_name, start_at, end_at);
    ELSE
        -- PostgreSQL refuses a partition whose rows sit in the DEFAULT one. The events move
        -- by copies (a DELETE would meet the append-only trigger): the DEFAULT partition is
        -- detached, the month's partition created, the old DEFAULT's rows inserted again
        -- through the parent (the month's into its partition, the others into a new DEFAULT),
        -- the old one dropped. The parent stays locked (ACCESS EXCLUSIVE) until commit.
        SET CONSTRAINTS ALL IMMEDIATE;  -- ALTER TABLE refuses pending foreign-key checks
        ALTER TABLE runs_runevent DETACH PARTITION runs_runevent_default;
        ALTER TABLE runs_runevent_default RENAME TO runs_runevent_default_moving;
        EXECUTE format('CREATE TABLE %I PARTITION OF runs_runevent FOR VALUES FROM (%L) TO (%L)',
                       partition_name, start_at, end_at);
        CREATE TABLE runs_runevent_default PARTITION OF runs_runevent DEFAULT;
        CREATE TRIGGER runs_runevent_default_no_truncate BEFORE TRUNCATE
            ON runs_runevent_default FOR EACH STATEMENT EXECUTE FUNCTION agentops_append_only();
        INSERT INTO runs_runevent SELECT * FROM runs_runevent_default_moving;
        SET CONSTRAINTS ALL IMMEDIATE;
        DROP TABLE runs_runevent_default_moving;
    END IF;
    EXECUTE format('CREATE TRIGGER %I BEFORE TRUNCATE ON %I FOR EACH STATEMENT '
                   'EXECUTE FUNCTION agentops_append_only()',
                   partition_name || '_no_truncate', partition_name);
    RETURN partition_name;
END
$$ LANGUAGE plpgsql;
"""


def _months(first: date, last: date) -> list[date]:
    months, month = [], date(first.year, first.month, 1)
    while month <= last:
        months.append(month)
        month = date(month.year + month.month // 12, month.month % 12 + 1, 1)
    return months


def _partition(cursor) -> None:
    def rows(sql: str, params: list | None = None) -> list:
        cursor.execute(sql, params or [])
        return cursor.fetchall()

    table = f"'{EVENTS}'::regclass"
    # what the table has beyond its columns, as PostgreSQL prints it
    foreign_keys = rows(
        f"SELECT conname, pg_get_constraintdef(oid) FROM pg_constraint "
        f"WHERE conrelid = {table} AND contype = 'f' ORDER BY conname"
    )
    uniques = rows(
        f"SELECT c.conname, array_agg(a.attname ORDER BY k.ord) FROM pg_constraint c, "
        f"unnest(c.conkey) WITH ORDINALITY k(attnum, ord) "
        f"JOIN pg_attribute a ON a.attrelid = {table} AND a.attnum = k.attnum "
        f"WHERE c.conrelid = {table} AND c.contype = 'u' GROUP BY c.conname ORDER BY c.conname"
    )
    indexes = rows(
        f"SELECT c.relname, pg_get_indexdef(i.indexrelid), i.indisunique FROM pg_index i "
        f"JOIN pg_class c ON c.oid = i.indexrelid WHERE i.indrelid = {table} "
        f"AND NOT EXISTS (SELECT FROM pg_constraint k WHERE k.conindid = i.indexrelid "
        f"AND k.conrelid = {table}) ORDER BY c.relname"
    )
    referenced_by = rows(f"SELECT conname FROM pg_constraint WHERE confrelid = {table}")
    if referenced_by or any(unique for _name, _sql, unique in indexes):
        raise RuntimeError(
            f"{EVENTS}: a foreign key points at it or a unique index is not a constraint "
            f"({referenced_by or indexes}): partition it by hand"
        )
    columns = [
        name
        for (name,) in rows(
            "SELECT attname FROM pg_attribute WHERE attrelid = "
            f"{table} AND attnum > 0 AND NOT attisdropped ORDER BY attnum"
        )
    ]
    ((sequence,),) = rows("SELECT pg_get_serial_sequence(%s, 'id')", [EVENTS])
    # an identity column (Django >= 4.1) owns its sequence; a serial one's is moved over
    ((identity,),) = rows(
        f"SELECT attidentity <> '' FROM pg_attribute WHERE attrelid = {table} AND attname = 'id'"
    )

    # the old table and everything named after it, out of the way of the new names
    cursor.execute(f"ALTER TABLE {EVENTS} RENAME TO {OLD}")
    for number, (name,) in enumerate(
        rows(f"SELECT c.relname FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid "
             f"WHERE i.indrelid = '{OLD}'::regclass")
    ):
        cursor.execute(f'ALTER INDEX "{name}" RENAME TO {OLD}_{number}')
    if identity:
        cursor.execute(f"ALTER SEQUENCE {sequence} RENAME TO {OLD}_id_seq")
    else:
        cursor.execute(f"ALTER SEQUENCE {sequence} OWNED BY NONE")
    for (trigger,) in rows(
        f"SELECT tgname FROM pg_trigger WHERE tgrelid = '{OLD}'::regclass AND NOT tgisinternal"
    ):
        cursor.execute(f'DROP TRIGGER "{trigger}" ON {OLD}')

    cursor.execute(
        f"CREATE TABLE {EVENTS} (LIKE {OLD} INCLUDING DEFAULTS INCLUDING IDENTITY "
        "INCLUDING CONSTRAINTS INCLUDING STORAGE INCLUDING COMMENTS) "
        "PARTITION BY RANGE (run_created_at)"
    )
    cursor.execute(f"ALTER TABLE {EVENTS} ALTER COLUMN run_created_at SET NOT NULL")
    cursor.execute(
        f"ALTER TABLE {EVENTS} ADD CONSTRAINT {EVENTS}_pkey PRIMARY KEY (id, run_created_at)"
    )
    for name, keys in uniques:
        keys = [key for key in keys if key != "run_created_at"]
        quoted = ", ".join(f'"{key}"' for key in [*keys, "run_created_at"])
        cursor.execute(f'ALTER TABLE {EVENTS} ADD CONSTRAINT "{name}" UNIQUE ({quoted})')
    for _name, definition, _unique in indexes:
        cursor.execute(definition)  # names the table by its name: the new one
    for name, definition in foreign_keys:
        cursor.execute(f'ALTER TABLE {EVENTS} ADD CONSTRAINT "{name}" {definition}')
    cursor.execute(
        f"CREATE TRIGGER {EVENTS}_append_only BEFORE UPDATE OR DELETE ON {EVENTS} "
        "FOR EACH ROW EXECUTE FUNCTION agentops_append_only()"
    )
    for partitioned in (EVENTS, f"{EVENTS}_default"):
        if partitioned != EVENTS:
            cursor.execute(f"CREATE TABLE {partitioned} PARTITION OF {EVENTS} DEFAULT")
        cursor.execute(
            f"CREATE TRIGGER {partitioned}_no_truncate BEFORE TRUNCATE ON {partitioned} "
            "FOR EACH STATEMENT EXECUTE FUNCTION agentops_append_only()"
        )
    cursor.execute(PARTITION_FUNCTION)

    ((oldest, now),) = rows("SELECT min(created_at), now() FROM runs_run")
    now = now.astimezone(UTC)
    first = (oldest or now).astimezone(UTC)
    last = datetime(now.year + (now.month + MONTHS_AHEAD - 1) // 12,
                    (now.month + MONTHS_AHEAD - 1) % 12 + 1, 1, tzinfo=UTC)
    for month in _months(first.date(), last.date()):
        cursor.execute("SELECT agentops_event_partition(%s)", [month])

    names = ", ".join(f'"{column}"' for column in columns)
    copied = ", ".join(
        "r.created_at" if column == "run_created_at" else f'e."{column}"' for column in columns
    )
    cursor.execute(
        f"INSERT INTO {EVENTS} ({names}) "
        f"SELECT {copied} FROM {OLD} e JOIN runs_run r ON r.id = e.run_id"
    )
    if identity:
        # ids go on from where the old table's sequence was
        cursor.execute(
            f"SELECT setval(pg_get_serial_sequence('{EVENTS}', 'id'), last_value, is_called) "
            f"FROM {OLD}_id_seq"
        )
    else:
        cursor.execute(f"ALTER SEQUENCE {sequence} OWNED BY {EVENTS}.id")
    # the privileges roles held on the old table (the application's role: SELECT, INSERT;
    # runs.dbrole), so it keeps working before `db_app_role --apply` runs again
    for role, privilege in rows(
        f"SELECT r.rolname, a.privilege_type FROM pg_class c, aclexplode(c.relacl) a "
        f"JOIN pg_roles r ON r.oid = a.grantee WHERE c.oid = '{OLD}'::regclass "
        f"AND a.grantee <> c.relowner"
    ):
        cursor.execute(f'GRANT {privilege} ON {EVENTS} TO "{role}"')
    # the copy's foreign-key checks now, not at commit: ALTER and DROP refuse pending ones
    cursor.execute("SET CONSTRAINTS ALL IMMEDIATE")
    cursor.execute(f"DROP TABLE {OLD}")
    cursor.execute("DROP FUNCTION IF EXISTS agentops_events_append_only()")


def forwards(apps, schema_editor):
    connection = schema_editor.connection
    if connection.vendor != "postgresql":
        schema_editor.execute(
            f"UPDATE {EVENTS} SET run_created_at = "
            f"(SELECT r.created_at FROM runs_run r WHERE r.id = {EVENTS}.run_id)",
            params=None,
        )
        return
    with connection.cursor() as cursor:
        _partition(cursor)


def backwards(apps, schema_editor):
    if schema_editor.connection.vendor == "postgresql":
        raise RuntimeError(
            "runs 0031 partitioned the run events: there is no way back on PostgreSQL but a "
            "restore of a backup taken before it"
        )


class Migration(migrations.Migration):
    dependencies = [("runs", "0030_config_generation")]

    operations = [
        migrations.AddField(
            model_name="runevent",
            name="run_created_at",
            field=models.DateTimeField(editable=False, null=True),
        ),
        migrations.RunPython(forwards, migrations.RunPython.noop),
        migrations.AlterField(
            model_name="runevent",
            name="run_created_at",
            field=models.DateTimeField(editable=False),
        ),
        # undone first: says why before anything is tried
        migrations.RunPython(migrations.RunPython.noop, backwards),
    ]

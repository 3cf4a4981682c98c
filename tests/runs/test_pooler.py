"""Behind a transaction pooler (AGENTOPS_PG_POOLER=transaction, docs/operations.md) a process
keeps nothing in its server session beyond a transaction: no named prepared statement, no
cursor held open. Each probe runs in a subprocess (settings are read once per process) inside
one transaction, so through a real PgBouncer too (.ci/pgbouncer) it reads the server
connection its own statements ran on."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from django.conf import settings
from django.db import ProgrammingError, connection

from runs.management.commands import runworker
from tests.runs.workerprocs import MANAGE, worker_env
from tests.test_deploy import manage, production_env

# a query repeated five times: psycopg prepares it from the second time on (the settings'
# prepare_threshold) unless told not to; and QuerySet.iterator(), a server-side cursor unless
# told not to. Rolled back: it leaves nothing behind.
PROBE = """
import json
from django.db import connection, transaction
from django.utils import timezone
from runs.models import Worker
with transaction.atomic():
    for _ in range(5):
        Worker.objects.filter(name="probe").exists()
    now = timezone.now()
    Worker.objects.create(name="probe", host="h", pid=1, started_at=now, heartbeat_at=now)
    rows = Worker.objects.filter(name="probe").iterator(chunk_size=1)
    next(rows)
    with connection.cursor() as cursor:
        cursor.execute("SELECT count(*) FROM pg_prepared_statements")
        prepared = cursor.fetchone()[0]
        cursor.execute("SELECT count(*) FROM pg_cursors")
        cursors = cursor.fetchone()[0]
    rows.close()
    transaction.set_rollback(True)
print(json.dumps({"prepared": prepared, "cursors": cursors}))
"""


def _probe(pooler: str) -> dict[str, int]:
    env = worker_env(AGENTOPS_PG_POOLER=pooler)
    result = subprocess.run(
        [sys.executable, MANAGE, "shell", "-c", PROBE],
        cwd=settings.BASE_DIR,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.fixture
def postgres_only():
    if connection.vendor != "postgresql":
        pytest.skip("prepared statements and server-side cursors: PostgreSQL only")


@pytest.mark.django_db
def test_behind_a_transaction_pooler_nothing_is_prepared_and_no_cursor_is_held(postgres_only):
    assert _probe("transaction") == {"prepared": 0, "cursors": 0}


@pytest.mark.django_db
@pytest.mark.parametrize("pooler", ["none", "session"])
def test_without_one_repeated_statements_are_prepared_and_iterators_use_cursors(
    postgres_only, pooler
):
    """What the transaction setting turns off (the probe can see it)."""
    if settings.PG_POOLER == "transaction":
        # the suite itself runs through a transaction pooler: a server connection may keep
        # another client's statement "_pg3_0", and preparing ours fails (the bug itself)
        pytest.skip("not through a transaction pooler")
    assert _probe(pooler) == {"prepared": 1, "cursors": 1}


@pytest.mark.parametrize(
    ("url", "pooler", "message"),
    [
        ("", "statement", "AGENTOPS_PG_POOLER='statement': use none, session or transaction"),
        # SET ROLE once per connection: a transaction pooler does not keep it
        ("?assume_role=app", "transaction", "assume_role runs SET ROLE once per connection"),
    ],
    ids=["statement-pooling", "assume-role"],
)
def test_what_a_transaction_pooler_cannot_keep_is_refused_at_start_up(
    tmp_path, url, pooler, message
):
    env = production_env(
        tmp_path,
        DATABASE_URL=f"postgres://agentops@127.0.0.1:5432/agentops{url}",
        AGENTOPS_PG_POOLER=pooler,
    )

    result = manage(env, "check")

    assert result.returncode != 0
    assert message in result.stderr


def test_a_worker_names_the_setting_when_a_transaction_pooler_lost_its_prepared_statement():
    error = ProgrammingError('prepared statement "_pg3_6" does not exist')

    problem = runworker._database_problem(error)

    assert problem.startswith('prepared statement "_pg3_6" does not exist: a transaction pooler')
    assert problem.endswith("set AGENTOPS_PG_POOLER=transaction")

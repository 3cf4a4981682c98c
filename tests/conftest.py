"""Shared fixtures: a real sandbox payments service, users in roles, and a driver that
advances a run through the real engine until it parks."""

from __future__ import annotations

import pytest
from django.conf import settings

from agentops.demo.sandbox import start_sandbox
from runs import engine
from runs.actors import Actor
from runs.models import Run
from runs.record import checkpoint as _checkpoint

# Event types only the suite writes, to try the record's mechanics (chains, fences, exports)
# with a type no engine path has: the product's checkpoint refuses them
# (runs.record.eventtypes is the catalogue).
_checkpoint.KNOWN_EVENT_TYPES = _checkpoint.KNOWN_EVENT_TYPES | {
    "run.note",
    "run.noted",
    "run.moved",
    "test.filler",
    "test.formula",
    "x.y",
}


def _flush_past_the_truncate_triggers() -> None:
    """``transaction=True`` tests end with Django's flush, one TRUNCATE of every table; on
    PostgreSQL the append-only tables refuse TRUNCATE (runs 0018) from anyone, owner included.
    The suite connects as a superuser, the one role allowed to switch triggers off for its own
    transaction (``session_replication_role``): the flush does that, nothing else does."""
    from django.db.backends.postgresql.operations import DatabaseOperations

    original = DatabaseOperations.sql_flush

    def sql_flush(self, style, tables, *, reset_sequences=False, allow_cascade=False):
        statements = original(
            self, style, tables, reset_sequences=reset_sequences, allow_cascade=allow_cascade
        )
        # execute_sql_flush runs the statements in one transaction: SET LOCAL ends with it
        return ["SET LOCAL session_replication_role = replica", *statements] if statements else []

    DatabaseOperations.sql_flush = sql_flush


_flush_past_the_truncate_triggers()


@pytest.fixture(autouse=True)
def _configuration_read_afresh():
    """Each test starts as a new process does, having read none of the operators'
    configuration (runs.record.configcache): what an earlier test's rolled-back transaction
    configured is not remembered into the next. Within a test the production mechanism
    holds — a change is seen at the next claim."""
    from runs.record import configcache

    configcache.forget_all()


@pytest.fixture(scope="session")
def sandbox_process(tmp_path_factory):
    db_path = tmp_path_factory.mktemp("sandbox") / "sandbox.sqlite3"
    process = start_sandbox(str(db_path), mode="nodedupe")
    yield process
    process.stop()


@pytest.fixture
def sandbox(sandbox_process, monkeypatch):
    """The sandbox in non-deduplicating mode, wiped before each test."""
    import httpx

    httpx.post(f"{sandbox_process.url}/reset", timeout=5).raise_for_status()
    # a test may have switched it at runtime
    httpx.post(
        f"{sandbox_process.url}/mode", json={"dedupe": False, "deadline": False}, timeout=5
    ).raise_for_status()
    monkeypatch.setitem(settings.AGENTOPS, "SANDBOX_URL", sandbox_process.url)
    return sandbox_process


@pytest.fixture
def system_actor() -> Actor:
    return Actor.system("cli")


def _user_in(django_user_model, username: str, *groups: str):
    from django.contrib.auth.models import Group

    user = django_user_model.objects.create_user(username=username, password="pw-" + username)
    for name in groups:
        user.groups.add(Group.objects.get(name=name))
    return user


@pytest.fixture
def operator(django_user_model):
    return _user_in(django_user_model, "olivia", "operator")


@pytest.fixture
def approver(django_user_model):
    return _user_in(django_user_model, "alice", "approver")


@pytest.fixture
def second_approver(django_user_model):
    return _user_in(django_user_model, "bob", "approver")


@pytest.fixture
def viewer(django_user_model):
    return _user_in(django_user_model, "victor", "viewer")


@pytest.fixture
def robot(django_user_model):
    """A service account in the agent role (the remote tests' manifests name it owner)."""
    return _user_in(django_user_model, "robby", "agent")


def drive(run_id, *, worker: str = "test-worker", max_slices: int = 20) -> Run:
    """Advance a run through the real engine until it stops being claimable."""
    for _ in range(max_slices):
        if engine.advance(run_id, worker=worker) == "not_claimed":
            break
    return Run.objects.get(id=run_id)


@pytest.fixture
def register():
    """Register test-only agents and tools; they are unregistered after the test. A name
    that is already registered (a demo agent or tool) is refused rather than shadowed."""
    from runs.registry import Tool, registry

    agents: list[str] = []
    tools: list[str] = []

    def _register(*items):
        for item in items:
            if isinstance(item, Tool):
                assert item.name not in {t.name for t in registry.tools()}, item.name
                registry.register_tool(item)
                tools.append(item.name)
            else:
                assert item.name not in {a.name for a in registry.agents()}, item.name
                registry.register_agent(item)
                agents.append(item.name)
        return items[0] if len(items) == 1 else items

    yield _register
    for name in agents:
        registry.unregister_agent(name)
    for name in tools:
        registry.unregister_tool(name)


@pytest.fixture
def roles():
    """The role groups, also in ``transaction=True`` tests: the flush after such a test
    empties every table, and the groups come from a data migration that does not run again.
    Request it before the user fixtures (``usefixtures`` does)."""
    from django.contrib.auth.models import Group, Permission

    from approvals.roles import ROLE_PERMISSIONS

    for role, perms in ROLE_PERMISSIONS.items():
        group, _ = Group.objects.get_or_create(name=role)
        for perm in perms:
            app_label, codename = perm.split(".")
            group.permissions.add(
                Permission.objects.get(content_type__app_label=app_label, codename=codename)
            )


@pytest.fixture
def worker_procs(tmp_path):
    """Real ``runworker`` processes against the test database (``transaction=True`` tests);
    every process group still alive when the test ends is SIGKILLed."""
    from tests.runs.workerprocs import Workers

    started = Workers(tmp_path)
    yield started
    started.cleanup()

"""Retention: ``prune`` empties old terminal runs' bulky data (archived first when asked),
keeps every event so the chains still verify, and records a ``run.pruned`` event."""

from __future__ import annotations

import hashlib
import io
import json
from datetime import timedelta

import pytest
from django.core.management import CommandError, call_command
from django.utils import timezone

from runs.actors import Actor
from runs.models import Run, RunEvent, Step, ToolCall, ToolReceipt
from runs.services import InvalidState, run_create, run_fork
from tests.conftest import drive

pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("roles")]


def _refund(system_actor, amount: int = 100) -> Run:
    run = run_create(
        agent_name="refund",
        input={"order_id": "ord_1001", "amount_cents": amount},
        actor=system_actor,
    )
    return drive(run.id)


def _age(run: Run, days: int) -> None:
    Run.objects.filter(id=run.id).update(finished_at=timezone.now() - timedelta(days=days))


@pytest.fixture
def old_run(sandbox, system_actor):
    run = _refund(system_actor)
    assert run.status == Run.Status.SUCCEEDED
    _age(run, 120)
    return Run.objects.get(id=run.id)


def _prune(*args: str) -> str:
    out = io.StringIO()
    call_command("prune", *args, stdout=out)
    return out.getvalue()


def test_prune_empties_bulky_data_and_keeps_the_chain_verifiable(old_run, tmp_path):
    events_before = list(RunEvent.objects.filter(run=old_run).order_by("seq").values())
    assert ToolCall.objects.filter(run=old_run).exclude(arguments={}).exists()

    out = _prune("--terminal-older-than", "90d", "--archive", str(tmp_path))

    assert "pruned 1 run(s)" in out
    old_run.refresh_from_db()
    assert old_run.state == {}
    assert not Step.objects.filter(run=old_run).exclude(input={}).exists()
    assert not Step.objects.filter(run=old_run, output__isnull=False).exists()
    assert not ToolCall.objects.filter(run=old_run).exclude(arguments={}).exists()
    assert not ToolReceipt.objects.filter(tool_call__run=old_run, result__isnull=False).exists()
    # every event kept, unchanged, plus one
    after = list(RunEvent.objects.filter(run=old_run).order_by("seq").values())
    assert after[: len(events_before)] == events_before
    pruned = RunEvent.objects.get(run=old_run, type="run.pruned")
    assert pruned.seq == len(events_before) + 1
    assert (pruned.actor, pruned.channel) == ("system", "cli")
    assert pruned.payload["older_than"] == "90d"
    call_command("audit_verify", run=str(old_run.id), stdout=io.StringIO())
    call_command("audit_verify", stdout=io.StringIO())


def test_the_archive_holds_what_was_emptied(old_run, tmp_path):
    steps = list(Step.objects.filter(run=old_run).order_by("seq").values("seq", "output"))
    arguments = list(ToolCall.objects.filter(run=old_run).values_list("arguments", flat=True))

    _prune("--terminal-older-than", "90d", "--archive", str(tmp_path / "archive"))

    (archive,) = (tmp_path / "archive").iterdir()
    (line,) = archive.read_text().splitlines(keepends=True)
    record = json.loads(line)
    assert record["run"]["id"] == str(old_run.id)
    assert [s["output"] for s in record["steps"]] == [s["output"] for s in steps]
    assert [c["arguments"] for c in record["tool_calls"]] == arguments
    # the run.pruned event names the archive and the digest of this exact line
    pruned = RunEvent.objects.get(run=old_run, type="run.pruned")
    assert pruned.payload["archive"] == archive.name
    assert pruned.payload["archive_digest"] == hashlib.sha256(line.encode()).hexdigest()


def test_dry_run_writes_nothing(old_run, tmp_path):
    seq = old_run.event_seq
    out = _prune("--terminal-older-than", "90d", "--dry-run", "--archive", str(tmp_path / "a"))
    assert "dry run: would prune 1 run(s)" in out
    old_run.refresh_from_db()
    assert old_run.event_seq == seq and old_run.state != {}
    assert not (tmp_path / "a").exists()


def test_only_old_terminal_runs_are_pruned(old_run, sandbox, system_actor):
    recent = _refund(system_actor, amount=200)
    _age(recent, 10)
    waiting = drive(
        run_create(
            agent_name="refund",
            input={"order_id": "ord_1004", "amount_cents": 50_000},
            actor=system_actor,
        ).id
    )
    Run.objects.filter(id=waiting.id).update(created_at=timezone.now() - timedelta(days=400))
    assert waiting.status == Run.Status.WAITING_APPROVAL

    _prune("--terminal-older-than", "30d")

    assert RunEvent.objects.filter(type="run.pruned").get().run_id == old_run.id


def test_pruning_twice_prunes_once(old_run):
    _prune("--terminal-older-than", "90d")
    assert "nothing to prune" in _prune("--terminal-older-than", "90d")
    assert RunEvent.objects.filter(run=old_run, type="run.pruned").count() == 1


def test_the_default_age_comes_from_settings(old_run, settings):
    settings.AGENTOPS = {**settings.AGENTOPS, "PRUNE_TERMINAL_AFTER": "200d"}
    assert "nothing to prune" in _prune()
    settings.AGENTOPS = {**settings.AGENTOPS, "PRUNE_TERMINAL_AFTER": "100d"}
    assert "pruned 1 run(s)" in _prune()


def test_a_pruned_run_cannot_be_forked(old_run):
    _prune("--terminal-older-than", "90d")
    with pytest.raises(InvalidState, match="pruned"):
        run_fork(run_id=old_run.id, actor=Actor.system("cli"), from_step=1)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--terminal-older-than", "ninety days"], "is not an age"),
        (["--terminal-older-than", "90"], "is not an age"),
        (["--terminal-older-than", "12h"], "at least 1d"),
        (["--terminal-older-than", "90d", "--limit", "0"], "--limit must be at least 1"),
    ],
)
def test_bad_arguments_are_clear_errors(args, message):
    with pytest.raises(CommandError, match=message):
        _prune(*args)


def test_an_unwritable_archive_directory_is_refused_before_anything_changes(old_run, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(CommandError, match="cannot create archive directory"):
        _prune("--terminal-older-than", "90d", "--archive", str(blocker / "sub"))
    assert not RunEvent.objects.filter(type="run.pruned").exists()

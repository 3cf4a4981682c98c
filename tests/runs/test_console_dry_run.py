"""Dry runs in the console (issue 23 item 5): the start form's checkbox (and its error naming
the tools), the mark on the runs list and the run page, and promotion from the run page
(a POST with CSRF) linked both ways."""

from __future__ import annotations

import pytest
from django.test import Client
from django.urls import reverse

from runs.models import Run
from runs.registry import CallTool, Effect, Finish, ToolResult
from runs.services import run_create
from tests.conftest import drive
from tests.support import CountingTool, ScriptedAgent, make_tool

pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("roles")]


@pytest.fixture
def writer(register):
    """``console_writer`` makes one idempotent write, which declares its dry run;
    ``console_blind`` makes one that declares none."""
    body = CountingTool()
    write = make_tool("console_write", body, effect=Effect.IDEMPOTENT)
    write.dry_run = lambda arguments, ctx: ToolResult(result={"would": "write"})

    def decide(ctx):
        return Finish(ctx.last_step.output) if ctx.steps else CallTool("console_write", {})

    register(
        write,
        make_tool("console_blind_write", CountingTool(), effect=Effect.UNSAFE),
        ScriptedAgent("console_writer", decide, tools=("console_write",)),
        ScriptedAgent("console_blind", decide, tools=("console_blind_write",)),
    )
    return body


def _finished_dry_run(system_actor) -> Run:
    run = drive(run_create(agent_name="console_writer", actor=system_actor, dry_run=True).id)
    assert run.status == Run.Status.SUCCEEDED
    return run


def _url(name: str, run: Run) -> str:
    return reverse(f"runs:{name}", args=[run.id])


def test_the_start_form_starts_a_dry_run(client, operator, writer):
    client.force_login(operator)
    form = client.get(reverse("runs:start")).content.decode()
    assert 'name="dry_run"' in form

    response = client.post(
        reverse("runs:start"), {"agent": "console_writer", "input": "{}", "dry_run": "on"}
    )

    run = Run.objects.get(agent_name="console_writer")
    assert response.status_code == 302 and response["Location"] == _url("detail", run)
    assert run.dry_run is True and run.principal == operator


def test_the_start_form_names_the_tools_that_cannot_be_dry_run(client, operator, writer):
    client.force_login(operator)

    response = client.post(
        reverse("runs:start"), {"agent": "console_blind", "input": "{}", "dry_run": "on"}
    )

    assert response.status_code == 400
    errors = response.context["form"].errors["dry_run"]
    assert "console_blind_write" in errors[0]
    assert not Run.objects.filter(agent_name="console_blind").exists()


def test_dry_runs_are_marked_on_the_list_and_the_page(client, viewer, writer, system_actor):
    run = _finished_dry_run(system_actor)
    real = run_create(agent_name="console_writer", actor=system_actor)
    client.force_login(viewer)

    listed = client.get(reverse("runs:list")).content.decode()
    assert listed.count("badge-dry-run") == 1
    page = client.get(_url("detail", run)).content.decode()
    assert "badge badge-dry-run" in page and "only simulated" in page
    # the timeline says so too
    assert "as a dry run" in page and "(dry run: simulated, nothing sent)" in page
    assert "badge-dry-run" not in client.get(_url("detail", real)).content.decode()
    assert writer.calls == []  # the tool's side effect was never called


def test_a_finished_dry_run_is_promoted_from_its_page_linked_both_ways(
    client, operator, writer, system_actor
):
    run = _finished_dry_run(system_actor)
    client.force_login(operator)
    assert "Promote to a real run" in client.get(_url("detail", run)).content.decode()

    unconfirmed = client.post(_url("promote", run), {}, HTTP_HX_REQUEST="true")
    assert unconfirmed.status_code == 400
    assert not Run.objects.filter(promoted_from=run).exists()

    response = client.post(_url("promote", run), {"confirm": "on"}, HTTP_HX_REQUEST="true")

    real = Run.objects.get(promoted_from=run)
    assert response.status_code == 204 and response["HX-Redirect"] == _url("detail", real)
    assert (real.dry_run, real.principal) == (False, operator)
    page = client.get(_url("detail", real)).content.decode()
    assert "Promoted from" in page and f'href="{_url("detail", run)}"' in page
    dry_page = client.get(_url("detail", run)).content.decode()
    assert f'href="{_url("detail", real)}"' in dry_page
    assert f"promoted by user:olivia: started for real as run {real.id}" in dry_page
    assert f"promoted from the dry run {run.id}" in page
    assert "Promote to a real run" not in dry_page  # once
    assert drive(real.id).status == Run.Status.SUCCEEDED
    assert len(writer.calls) == 1  # for real, this time


def test_promotion_needs_the_csrf_token_and_the_start_permission(
    operator, viewer, writer, system_actor
):
    run = _finished_dry_run(system_actor)
    strict = Client(enforce_csrf_checks=True)
    strict.force_login(operator)
    assert strict.post(_url("promote", run), {"confirm": "on"}).status_code == 403
    plain = Client()
    plain.force_login(viewer)
    assert plain.post(_url("promote", run), {"confirm": "on"}).status_code == 403
    assert not Run.objects.filter(promoted_from=run).exists()

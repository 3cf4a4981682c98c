"""``seed_demo``: a sign-in for a person and a few runs, created once."""

from __future__ import annotations

import re

import pytest
from django.contrib.auth import authenticate, get_user_model
from django.core.management import call_command
from django.test import RequestFactory

from agentops.demo.tools import REFUND_APPROVAL_THRESHOLD_CENTS
from runs.models import Run


@pytest.mark.django_db
@pytest.mark.usefixtures("roles")
def test_seed_demo_creates_a_sign_in_and_demo_runs_once(capsys):
    call_command("seed_demo")
    out = capsys.readouterr().out
    password = re.search(r"sign-in 'demo' with password (\S+)", out).group(1)

    # django-axes checks every sign-in against its request (the address it came from)
    sign_in = RequestFactory().post("/accounts/login/")
    demo = authenticate(sign_in, username="demo", password=password)
    assert demo is not None and not demo.is_superuser and not demo.is_staff
    assert set(demo.groups.values_list("name", flat=True)) == {
        "operator",
        "approver",
        "viewer",
        "admin",
    }
    assert demo.has_perm("runs.view_run") and demo.has_perm("approvals.decide_approval")
    # a second approver decides what demo starts (nobody approves their own run)
    second = re.search(r"sign-in 'demo-approver' with password (\S+)", out).group(1)
    approver = authenticate(sign_in, username="demo-approver", password=second)
    # ... and is the finance team a policy can ask for ("at least one from finance")
    assert set(approver.groups.values_list("name", flat=True)) == {
        "approver",
        "viewer",
        "finance",
    }
    assert approver.has_perm("approvals.decide_approval")
    assert not approver.has_perm("runs.start_run")
    # a second admin publishes the approval policy demo drafts (separation of duties)
    second_admin = re.search(r"sign-in 'demo-admin' with password (\S+)", out).group(1)
    admin = authenticate(sign_in, username="demo-admin", password=second_admin)
    assert admin.has_perm("approvals.manage_approvalpolicy")
    assert demo.has_perm("approvals.manage_approvalpolicy")

    runs = list(Run.objects.all())
    assert {run.agent_name for run in runs} == {"refund", "followup"}
    assert all(run.status == Run.Status.QUEUED for run in runs)
    large = [
        run
        for run in runs
        if run.agent_name == "refund"
        and run.input["amount_cents"] > REFUND_APPROVAL_THRESHOLD_CENTS
    ]
    assert len(large) == 1
    # the runs act as a service account, so the demo person may approve the large refund
    assert {run.principal.username for run in runs} == {"demo-agent"}
    assert not runs[0].principal.has_usable_password()

    call_command("seed_demo")
    again = capsys.readouterr().out
    assert "password" not in again
    assert "no demo runs created" in again
    assert Run.objects.count() == len(runs)
    assert authenticate(sign_in, username="demo", password=password) is not None
    assert get_user_model().objects.filter(username="demo").count() == 1


@pytest.mark.django_db
@pytest.mark.usefixtures("roles")
def test_seed_demo_force_adds_runs_even_when_some_exist(capsys):
    call_command("seed_demo")
    first = Run.objects.count()
    call_command("seed_demo", "--force")
    assert Run.objects.count() == 2 * first

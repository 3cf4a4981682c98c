"""Demo data for ``make run``: one sign-in for a person and a few runs to watch.

The runs are created through ``runs.services.run_create`` like any other run, so the worker
advances them exactly as it would real work.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from typing import Any

from django.contrib.auth import get_user_model
from django.contrib.auth.models import Group
from django.db import transaction

from runs.actors import Actor
from runs.models import Run
from runs.services import run_create

DEMO_USERNAME = "demo"
# ``demo`` is an admin too, and so is ``demo-admin``: an approval policy is drafted by one
# admin and published by another (docs/approvals.md, "Policies"), so the demo seeds two
DEMO_GROUPS = ("operator", "approver", "viewer", "admin")
SECOND_APPROVER_USERNAME = "demo-approver"
SECOND_APPROVER_GROUPS = ("approver", "viewer", "finance")
# not a role: a team an approval policy can ask for ("two approvers, at least one from
# finance", docs/approvals.md "Quorum"); demo-approver is its one member
FINANCE_GROUP = "finance"
SECOND_ADMIN_USERNAME = "demo-admin"
SECOND_ADMIN_GROUPS = ("admin", "viewer")
# The runs act as this service account, not as the demo person: an approver may not approve
# an action taken in their own name, and the demo login should be able to approve.
SERVICE_USERNAME = "demo-agent"

# Orders that exist in the sandbox's seed data (agentops/demo/sandbox.py SEED_ORDERS).
DEMO_RUNS: tuple[dict[str, Any], ...] = (
    {
        "agent_name": "refund",
        "goal": "Refund a late delivery fee",
        "input": {"order_id": "ord_1001", "amount_cents": 500, "reason": "late delivery"},
    },
    {
        "agent_name": "refund",
        "goal": "Refund a damaged item",
        "input": {"order_id": "ord_1002", "amount_cents": 1500, "reason": "damaged item"},
    },
    {
        "agent_name": "refund",
        "goal": "Refund a duplicate charge",
        "input": {"order_id": "ord_1005", "amount_cents": 799, "reason": "charged twice"},
    },
    {
        "agent_name": "refund",
        "goal": "Refund a cancelled order in full (above 100.00: needs an approver)",
        "input": {"order_id": "ord_1004", "amount_cents": 250000, "reason": "order cancelled"},
    },
    {
        "agent_name": "followup",
        "goal": "Tell a customer their refund is on its way",
        "input": {
            "order_id": "ord_1003",
            "message": "Your refund has been issued and should arrive within 5 days.",
        },
    },
)


@dataclass(frozen=True)
class DemoLogin:
    username: str
    password: str | None  # only when it was created now: it is never shown again


def demo_login_ensure(
    username: str = DEMO_USERNAME, groups: tuple[str, ...] = DEMO_GROUPS
) -> DemoLogin:
    """Create a demo sign-in once (not a superuser: the roles' groups grant what it may
    do). An existing one keeps its password."""
    User = get_user_model()
    with transaction.atomic():
        user = User.objects.filter(username=username).first()
        password = None
        if user is None:
            password = secrets.token_urlsafe(12)
            user = User.objects.create_user(username=username, password=password)
        if not user.email:
            # approval emails go to approvers with an address (printed by the console backend)
            user.email = f"{username}@localhost"
            user.save(update_fields=["email"])
        found = list(Group.objects.filter(name__in=groups))
        if len(found) != len(groups):
            # the roles come from a data migration; without them the login could see nothing
            raise LookupError(
                f"the role groups {', '.join(groups)} are missing: run `manage.py migrate`"
            )
        user.groups.add(*found)
    return DemoLogin(username=username, password=password)


def demo_logins_ensure() -> list[DemoLogin]:
    """``demo``, and a second approver: nobody approves a run they started (separation of
    duties), so a refund ``demo`` starts from the form is decided by ``demo-approver``."""
    Group.objects.get_or_create(name=FINANCE_GROUP)
    return [
        demo_login_ensure(),
        demo_login_ensure(SECOND_APPROVER_USERNAME, SECOND_APPROVER_GROUPS),
        demo_login_ensure(SECOND_ADMIN_USERNAME, SECOND_ADMIN_GROUPS),
    ]


def demo_service_account_ensure() -> Any:
    """The principal the demo runs act as: a service account nobody can sign in as."""
    User = get_user_model()
    with transaction.atomic():
        account, created = User.objects.get_or_create(username=SERVICE_USERNAME)
        if created:
            account.set_unusable_password()
            account.save(update_fields=["password"])
            account.groups.add(*Group.objects.filter(name="operator"))
    return account


def demo_runs_seed(*, force: bool = False) -> list[Run]:
    """Create the demo runs, unless runs exist already (``force`` creates them anyway)."""
    if not force and Run.objects.exists():
        return []
    principal = demo_service_account_ensure()
    actor = Actor.system("cli")
    return [run_create(actor=actor, principal=principal, **spec) for spec in DEMO_RUNS]

"""The permission matrix (issue 16, item 5): every state-changing action, through every
channel (API, console, emailed link, admin site, the remote-agent protocol), tried as every
principal — anonymous, a user with no role, each role, a superuser, the agent role's service
account — and the database read after each try: an allowed action changed the record, a
refused one changed nothing at all (not only "the status code was 4xx").

The table (``ALLOWED``) is docs/api.md's "Who may do what". Each case builds only the state
its action needs (a queued run, a parked approval, a held lease...): the whole matrix (about
300 cases) takes under a minute of CPU.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
from django.contrib.auth.models import Group
from django.test import Client
from rest_framework.test import APIClient

from approvals.models import Approval, ApprovalDecision, ApprovalLink, ApprovalPolicyVersion
from approvals.policy_services import policy_version_draft, policy_version_publish
from runs.actors import Actor
from runs.models import (
    AgentManifest,
    Question,
    Run,
    RunEvent,
    Signal,
    SpendCap,
    SpendCounter,
    Step,
    ToolCall,
    ToolLimit,
)
from runs.services import run_pause
from tests.api.conftest import token_for
from tests.api.remote_support import MANIFEST, Agent, register_remote, remote_run

pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("roles")]

ROLES = [
    "anonymous",
    "norole",
    "viewer",
    "operator",
    "approver",
    "auditor",
    "admin",
    "superuser",
    "agent",
]
OPERATE = {"operator", "admin", "superuser"}
LINK_RE = r"/(?:approvals|questions)/link/([A-Za-z0-9_-]+)/"


# --- the world each case starts from ---------------------------------------------------------


@dataclass
class World:
    starter: Any  # the operator who started the runs (not the principal under test)
    owner: Any  # the agent's owner, in the agent role
    tester: Any  # the principal under test (None: anonymous)
    role: str
    mailbox: list
    capture: Callable

    def holder(self, run: Run) -> Agent:
        """The owner's agent process, holding ``run``'s lease."""
        agent = Agent(api_client(self.owner), run.id)
        assert agent.lease(owner="proc").status_code == 200
        return agent


def _user(django_user_model, username: str, *groups: str, **extra):
    # staff for everyone: the admin site's actions must be refused for want of a permission,
    # not of the staff flag
    user = django_user_model.objects.create_user(
        username=username, email=f"{username}@example.com", is_staff=True, **extra
    )
    user.groups.add(*Group.objects.filter(name__in=groups))
    return user


_token_names = iter(range(10**9))


def api_client(user) -> APIClient:
    """A client with a token of its own (the agent process and the principal under test may
    be the same account)."""
    client = APIClient()
    if user is not None:
        raw = token_for(user, f"{user.username}-{next(_token_names)}")
        client.credentials(HTTP_AUTHORIZATION=f"Bearer {raw}")
    return client


def web_client(user) -> Client:
    client = Client()
    if user is not None:
        client.force_login(user)
    return client


@pytest.fixture
def world(request, django_user_model, django_capture_on_commit_callbacks, mailoutbox) -> World:
    role = request.node.callspec.params["role"]
    admin = django_user_model.objects.create_superuser("root", email="root@example.com")
    starter = _user(django_user_model, "olivia", "operator")
    owner = _user(django_user_model, "robby", "agent")
    _user(django_user_model, "alice", "approver")  # an approver who is not under test
    testers = {
        "anonymous": lambda: None,
        "norole": lambda: _user(django_user_model, "nora"),
        "superuser": lambda: _user(django_user_model, "sue", is_superuser=True),
        "agent": lambda: owner,  # the legitimate agent account itself
    }
    tester = testers.get(role, lambda: _user(django_user_model, f"t-{role}", role))()
    register_remote(admin, owner=owner)
    return World(starter, owner, tester, role, mailoutbox, django_capture_on_commit_callbacks)


def _snapshot() -> tuple:
    """Everything any of these actions could change."""
    return (
        sorted(
            Run.objects.values_list(
                "id",
                "status",
                "event_seq",
                "fence",
                "lease_expires_at",
                "max_steps",
                "requested_action",
            )
        ),
        RunEvent.objects.count(),
        Step.objects.count(),
        sorted(ToolCall.objects.values_list("id", "status", "attempt_count", "lookups_begun")),
        Signal.objects.count(),
        sorted(Approval.objects.values_list("id", "status")),
        ApprovalDecision.objects.count(),
        sorted(ApprovalLink.objects.values_list("id", "used_at")),
        sorted(Question.objects.values_list("id", "status")),
        sorted(ApprovalPolicyVersion.objects.values_list("id", "status")),
        sorted(
            (m.name, m.version, m.owner_id, json.dumps(m.question_groups), json.dumps(m.tools))
            for m in AgentManifest.objects.all()
        ),
        sorted(ToolLimit.objects.values_list("tool_name", "max_in_flight", "rate")),
        sorted(SpendCap.objects.values_list("scope", "subject", "max_cost")),
        sorted(SpendCounter.objects.values_list("scope", "subject", "period", "cost_added")),
    )


# --- states the actions apply to ---------------------------------------------------------------


def queued(w: World) -> Run:
    return remote_run(w.starter)


def paused(w: World) -> Run:
    run = queued(w)
    return run_pause(run_id=run.id, actor=Actor.system("cli"))


def dead_lettered(w: World) -> Run:
    run = queued(w)
    Run.objects.filter(id=run.id).update(
        status=Run.Status.NEEDS_ATTENTION, reason_code=Run.Reason.RECOVERY_LIMIT, recovery_count=4
    )
    return run


def finished_dry_run(w: World) -> Run:
    from runs.services import run_create, run_terminate

    run = run_create(
        agent_name="pay_bot",
        input={"order_id": "o"},
        actor=Actor.for_user(w.starter, "api"),
        dry_run=True,
    )
    return run_terminate(run_id=run.id, actor=Actor.system("cli"), reason="seen enough")


def with_a_step(w: World) -> Run:
    run = queued(w)
    agent = w.holder(run)
    assert agent.run_post("steps", {"output": {"plan": 1}}).status_code == 201
    assert agent.run_post("lease/release").status_code == 200
    return run


def unknown_call(w: World) -> tuple[Run, int]:
    run = queued(w)
    agent = w.holder(run)
    call = agent.propose("notify", {}).json()["tool_call"]["id"]
    agent.dispatch(call)
    agent.receipt(call, outcome="unknown")  # unsafe: the run needs a person
    return run, call


def pending_approval(w: World) -> tuple[Run, Approval]:
    run = queued(w)
    agent = w.holder(run)
    with w.capture(execute=True):  # the request emails, with their links
        proposed = agent.propose("refund", {"order_id": "o", "amount_cents": 20000})
    assert proposed.json()["decision"] == "awaiting_approval"
    return run, Approval.objects.get(run=run)


POLICY_RULES = [{"when": "args.amount_cents > 5000", "decide": "require_approval"}]
POLICY_DRAFT = {"tool": "refund_payment", "rules": POLICY_RULES, "note": "above 50.00"}
ADMINS = {"admin", "superuser"}


def drafted(w: World) -> ApprovalPolicyVersion:
    """A policy draft by an admin who is not the principal under test (the drafter may not
    publish it)."""
    from django.contrib.auth import get_user_model

    drafter = get_user_model().objects.create_user(username="drafty")
    drafter.groups.add(*Group.objects.filter(name="admin"))
    return policy_version_draft(
        actor=Actor.for_user(drafter, "web"),
        tool_name="refund_payment",
        rules=POLICY_RULES,
        note="above 50.00",
    )


def published(w: World) -> ApprovalPolicyVersion:
    """A policy in force: drafted by one admin, published by another (neither the
    principal under test), so that it can be withdrawn."""
    from django.contrib.auth import get_user_model

    version = drafted(w)
    publisher = get_user_model().objects.create_user(username="publy")
    publisher.groups.add(*Group.objects.filter(name="admin"))
    version, _ = policy_version_publish(
        actor=Actor.for_user(publisher, "web"), version_id=version.id
    )
    return version


def policy_form() -> dict[str, str]:
    return {
        "tool": "refund_payment",
        "time_zone": "UTC",
        "note": "above 50.00",
        "rules-TOTAL_FORMS": "1",
        "rules-INITIAL_FORMS": "0",
        "rules-0-when": "args.amount_cents > 5000",
        "rules-0-decide": "require_approval",
        "rules-0-group": "approver",
        "rules-0-required": "1",
    }


def asked(w: World) -> tuple[Run, Question]:
    run = queued(w)
    agent = w.holder(run)
    with w.capture(execute=True):
        answer = agent.run_post(
            "waits", {"kind": "question", "text": "Refund?", "group": "operator"}
        )
    assert answer.status_code == 201, answer.content
    return run, Question.objects.get(run=run)


def link_of(w: World, kind: str) -> str:
    """The emailed link of the principal under test if it got one, else another
    recipient's (a forwarded email): a link decides only for its own signed-in recipient."""
    import re

    mine = [m for m in w.mailbox if w.tester is not None and w.tester.email in m.to]
    messages = mine or w.mailbox
    assert messages, "no email was sent"
    return f"/{kind}/link/{re.search(LINK_RE, messages[-1].body).group(1)}/"


# --- the actions ---------------------------------------------------------------------------------


def api_post(w: World, path: str, body: dict | None = None, method: str = "post") -> Any:
    client = api_client(w.tester)
    return getattr(client, method)(f"/api/v1/{path}", body or {}, format="json")


def fenced(what: str, body: dict | None = None, *, call: str | None = None):
    """A write of the remote protocol into the owner's lease, sent with the lease's real
    fence and token (the strongest case: the secret leaked to the principal under test)."""

    def act(w: World) -> Any:
        run = queued(w)
        holder = w.holder(run)
        path = f"runs/{run.id}/{what}/"
        if call is not None:
            proposed = holder.propose("lookup", {}).json()["tool_call"]["id"]
            if call in ("lookups", "receipt"):
                assert holder.dispatch(proposed).status_code == 200
            path = f"tool-calls/{proposed}/{call}/"
        proof = {"fence": holder.fence, "lease_token": holder.lease_token}
        before = _snapshot()
        return before, api_post(w, path, {**proof, **(body or {})})

    return act


def simple(make: Callable[[World], Any], do: Callable[[World, Any], Any]):
    def act(w: World) -> Any:
        made = make(w)
        before = _snapshot()
        return before, do(w, made)

    return act


def _global_day_cap(w: World) -> None:
    SpendCap.objects.create(scope="global_day", max_cost=5, set_by="test")


def web_post(w: World, path: str, data: dict) -> Any:
    return web_client(w.tester).post(path, data)


START_FORM = {"agent": "pay_bot", "goal": "g", "input": json.dumps({"order_id": "o"})}

ACTIONS: dict[str, tuple[Callable[[World], Any], set[str]]] = {
    # --- the API -------------------------------------------------------------------------------
    "api start run": (
        simple(
            lambda w: None,
            lambda w, _: api_post(w, "runs/", {"agent": "pay_bot", "input": {"order_id": "o"}}),
        ),
        OPERATE,
    ),
    "api pause": (simple(queued, lambda w, r: api_post(w, f"runs/{r.id}/pause/")), OPERATE),
    "api resume": (simple(paused, lambda w, r: api_post(w, f"runs/{r.id}/resume/")), OPERATE),
    "api terminate": (
        simple(queued, lambda w, r: api_post(w, f"runs/{r.id}/terminate/", {"reason": "x"})),
        OPERATE,
    ),
    "api set tool limit": (
        simple(
            lambda w: None,
            lambda w, _: api_post(w, "tool-limits/", {"tool_name": "refund_payment", "rate": 5}),
        ),
        OPERATE,
    ),
    "api set spend cap": (
        simple(
            lambda w: None,
            lambda w, _: api_post(w, "spend-caps/", {"scope": "global_day", "max_cost": "5"}),
        ),
        OPERATE,
    ),
    "api top up spend cap": (
        simple(
            _global_day_cap,
            lambda w, _: api_post(
                w, "spend-caps/top-up/", {"scope": "global_day", "add_cost": "1"}
            ),
        ),
        OPERATE,
    ),
    "api top up budget": (
        simple(queued, lambda w, r: api_post(w, f"runs/{r.id}/budget/", {"add_steps": 5})),
        OPERATE,
    ),
    "api fork": (
        simple(with_a_step, lambda w, r: api_post(w, f"runs/{r.id}/fork/", {"from_step": 1})),
        OPERATE,
    ),
    "api promote dry run": (
        simple(finished_dry_run, lambda w, r: api_post(w, f"runs/{r.id}/promote/")),
        OPERATE,
    ),
    "api retry recovery": (
        simple(dead_lettered, lambda w, r: api_post(w, f"runs/{r.id}/retry-recovery/")),
        OPERATE,
    ),
    "api signal": (
        simple(queued, lambda w, r: api_post(w, f"runs/{r.id}/signals/", {"name": "go"})),
        OPERATE,
    ),
    "api resolve unknown outcome": (
        simple(
            unknown_call,
            lambda w, rc: api_post(w, f"tool-calls/{rc[1]}/resolution/", {"outcome": "happened"}),
        ),
        OPERATE,
    ),
    "api decide approval": (
        simple(
            pending_approval,
            lambda w, ra: api_post(w, f"approvals/{ra[1].id}/decision/", {"decision": "approve"}),
        ),
        {"approver", "superuser"},
    ),
    "api register manifest": (
        simple(
            lambda w: None,
            lambda w, _: api_post(w, "agents/pay_bot/", {**MANIFEST, "version": "2"}, "put"),
        ),
        {"admin", "superuser"},
    ),
    # --- the remote-agent protocol -------------------------------------------------------------
    "api draft policy": (
        simple(lambda w: None, lambda w, _: api_post(w, "policies/", POLICY_DRAFT)),
        ADMINS,
    ),
    "api publish policy": (
        simple(drafted, lambda w, v: api_post(w, f"policy-versions/{v.id}/publication/")),
        ADMINS,
    ),
    "api withdraw policy": (
        simple(
            published,
            lambda w, v: api_post(w, f"policies/{v.policy_id}/withdrawal/", {"note": "pilot over"}),
        ),
        ADMINS,
    ),
    "protocol lease": (simple(queued, lambda w, r: api_post(w, f"runs/{r.id}/lease/")), {"agent"}),
    "protocol heartbeat": (fenced("lease/heartbeat"), {"agent"}),
    "protocol release": (fenced("lease/release"), {"agent"}),
    "protocol step": (fenced("steps", {"state": {"x": 1}}), {"agent"}),
    "protocol propose": (fenced("tool-calls", {"tool": "lookup", "arguments": {}}), {"agent"}),
    "protocol wait": (fenced("waits", {"kind": "timer", "seconds": 60}), {"agent"}),
    "protocol finish": (fenced("finish", {"result": {}}), {"agent"}),
    "protocol dispatch": (fenced("", call="dispatch"), {"agent"}),
    "protocol lookup": (fenced("", call="lookups"), {"agent"}),
    "protocol receipt": (fenced("", {"outcome": "succeeded"}, call="receipt"), {"agent"}),
    # --- the console -----------------------------------------------------------------------------
    "console start run": (
        simple(lambda w: None, lambda w, _: web_post(w, "/runs/start/", START_FORM)),
        OPERATE,
    ),
    "console pause": (
        simple(queued, lambda w, r: web_post(w, f"/runs/{r.id}/pause/", {"reason": "x"})),
        OPERATE,
    ),
    "console resume": (
        simple(paused, lambda w, r: web_post(w, f"/runs/{r.id}/resume/", {})),
        OPERATE,
    ),
    "console terminate": (
        simple(
            queued,
            lambda w, r: web_post(w, f"/runs/{r.id}/terminate/", {"reason": "x", "confirm": "on"}),
        ),
        OPERATE,
    ),
    "console set tool limit": (
        simple(
            lambda w: None,
            lambda w, _: web_post(
                w,
                "/limits/",
                {"tool_name": "refund_payment", "max_in_flight": "2", "per_seconds": "1"},
            ),
        ),
        OPERATE,
    ),
    "console set spend cap": (
        simple(
            lambda w: None,
            lambda w, _: web_post(
                w, "/spend/", {"action": "set", "scope": "global_day", "max_cost": "5"}
            ),
        ),
        OPERATE,
    ),
    "console top up budget": (
        simple(queued, lambda w, r: web_post(w, f"/runs/{r.id}/budget/", {"add_steps": "5"})),
        OPERATE,
    ),
    "console fork": (
        simple(with_a_step, lambda w, r: web_post(w, f"/runs/{r.id}/fork/", {"from_step": "1"})),
        OPERATE,
    ),
    "console promote dry run": (
        simple(
            finished_dry_run, lambda w, r: web_post(w, f"/runs/{r.id}/promote/", {"confirm": "on"})
        ),
        OPERATE,
    ),
    "console resolve unknown outcome": (
        simple(
            unknown_call,
            lambda w, rc: web_post(
                w,
                f"/tool-calls/{rc[1]}/resolve/",
                {"outcome": "not_happened", "attestation": "checked"},
            ),
        ),
        OPERATE,
    ),
    "console decide approval": (
        simple(
            pending_approval,
            lambda w, ra: web_post(w, f"/approvals/{ra[1].id}/decide/", {"action": "approve"}),
        ),
        {"approver", "superuser"},
    ),
    "console decide approvals from the inbox": (
        simple(
            pending_approval,
            lambda w, ra: web_post(
                w,
                "/approvals/bulk/",
                {"decision": "approve", "approval": ra[1].id, "confirm": "on"},
            ),
        ),
        {"approver", "superuser"},
    ),
    "console triage unknown outcomes": (
        simple(
            unknown_call,
            lambda w, rc: web_post(
                w,
                "/unknown/triage/",
                {"outcome": "not_happened", "call": rc[1], "attestation": "checked"},
            ),
        ),
        OPERATE,
    ),
    "console answer question": (
        simple(asked, lambda w, rq: web_post(w, f"/questions/{rq[1].id}/", {"answer": "yes"})),
        {"operator", "superuser"},
    ),
    "console draft policy": (
        simple(
            lambda w: None, lambda w, _: web_post(w, "/approvals/policies/draft/", policy_form())
        ),
        ADMINS,
    ),
    "console publish policy": (
        simple(
            drafted,
            lambda w, v: web_post(w, f"/approvals/policies/versions/{v.id}/publish/", {}),
        ),
        ADMINS,
    ),
    "console withdraw policy": (
        simple(
            published,
            lambda w, v: web_post(
                w, f"/approvals/policies/{v.policy_id}/withdraw/", {"note": "pilot over"}
            ),
        ),
        ADMINS,
    ),
    # --- emailed links (POST, signed in, confirmation ticked) ---------------------------------
    "link decide approval": (
        simple(
            pending_approval,
            lambda w, _: web_post(
                w, link_of(w, "approvals"), {"decision": "approve", "confirm": "yes"}
            ),
        ),
        {"approver"},  # only the link's own recipient; a superuser got no link
    ),
    "link answer question": (
        simple(asked, lambda w, _: web_post(w, link_of(w, "questions"), {"answer": "yes"})),
        {"operator"},
    ),
    # --- the admin site --------------------------------------------------------------------------
    "admin pause runs": (
        simple(
            queued,
            lambda w, r: web_post(
                w,
                "/admin/runs/run/",
                {"action": "pause_runs", "_selected_action": [str(r.id)], "index": 0},
            ),
        ),
        OPERATE,
    ),
}


def _cases():
    for action in ACTIONS:
        for role in ROLES:
            yield pytest.param(action, role, id=f"{action}-{role}")


@pytest.mark.parametrize(("action", "role"), list(_cases()))
def test_the_action_changes_the_record_only_for_whom_it_is_allowed(action, role, world):
    act, allowed = ACTIONS[action]
    before, response = act(world)
    after = _snapshot()
    status = getattr(response, "status_code", None)
    if role in allowed:
        assert after != before, f"{action} as {role}: allowed, but nothing changed ({status})"
        assert status is not None and status < 400, (status, getattr(response, "content", b""))
    else:
        assert after == before, f"{action} as {role}: refused ({status}), yet the record changed"

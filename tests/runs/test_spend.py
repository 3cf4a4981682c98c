"""Spend and token caps by scope and period (issue 26 item 3, docs/agents.md "Spend caps"):
checked before each model request and tool call from persisted usage plus reservations, a
full scope stops its runs (``budget_exhausted``, the scope named) until a top-up resumes
them, and a model request a crash cut off stays charged until an operator settles it."""

from __future__ import annotations

from decimal import Decimal

import pytest

from runs import engine, spend
from runs.actors import Actor, PermissionDenied
from runs.models import Alert, AuditEntry, Run, SpendCounter, SpendReservation, SpendStop
from runs.registry import CallTool, Decision, Effect, Finish, Tool, Usage
from runs.services import BudgetExhausted, run_create
from tests.conftest import _user_in, drive
from tests.runs.test_metrics import scrape, value
from tests.support import CountingTool, ScriptedAgent, WorkerKilled, events, expire_lease, make_tool

# transaction=True: alerts are raised after the commits that cross a cap (on_commit)
pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("roles")]

DECISION = Usage(tokens=100, cost=Decimal("1"))


class ModelAgent(ScriptedAgent):
    """Stands in for an LLM agent: every decision declares its maximum, costs ``DECISION``
    and reads once; it finishes after ``steps`` steps. ``crash`` kills the worker inside
    the next decision (after its reservation was committed)."""

    def __init__(self, name: str, *, steps: int = 4, maximum: Usage = DECISION) -> None:
        self.maximum = maximum
        self.plan = {"crash": False, "asked": 0}

        def decide(ctx):
            self.plan["asked"] += 1
            if self.plan["crash"]:
                self.plan["crash"] = False
                raise WorkerKilled
            action = (
                Finish({"done": True}) if len(ctx.steps) >= steps else CallTool("spend_read", {})
            )
            return Decision(action=action, usage=DECISION)

        super().__init__(name, decide, tools=("spend_read",))

    def decision_maximum(self, run):
        return self.maximum


@pytest.fixture
def olivia(operator) -> Actor:
    return Actor.for_user(operator, "web")


@pytest.fixture
def model_agent(register) -> ModelAgent:
    agent = ModelAgent("thinker")
    register(make_tool("spend_read", CountingTool()), agent)
    return agent


def test_a_principals_daily_cap_pauses_its_runs_and_a_top_up_resumes_them(
    model_agent, olivia, django_user_model, mailoutbox, client
):
    bob = _user_in(django_user_model, "bob", "operator")
    # every operator is emailed alerts; olivia has an address
    olivia.user.email = "olivia@example.com"
    olivia.user.save()
    spend.spend_cap_set(
        scope="principal_day", subject="olivia", max_cost="2.5", actor=olivia, reason="team"
    )
    mine = [run_create(agent_name="thinker", actor=olivia) for _ in range(2)]
    other = run_create(agent_name="thinker", actor=Actor.for_user(bob, "web"))

    first = drive(mine[0].id)
    # 1 + 1 + 1 reserved and settled, the fourth check finds 3 of 2.5: stopped, not ended
    assert (first.status, first.reason_code) == (Run.Status.NEEDS_ATTENTION, "budget_exhausted")
    assert "spend cap reached: principal olivia per day" in first.reason_detail
    assert first.cost_used == Decimal("3")
    (reached,) = events(first.id, "spend.cap_reached")
    assert reached.payload["scope"] == "principal_day"
    assert reached.payload["subject"] == str(olivia.user.pk)
    second = drive(mine[1].id)
    assert (second.status, second.reason_code) == (Run.Status.NEEDS_ATTENTION, "budget_exhausted")
    assert second.steps_used == 0  # stopped before its first model request
    # another principal's runs are not in the scope
    assert drive(other.id).status == Run.Status.SUCCEEDED

    counter = SpendCounter.objects.get(scope="principal_day", subject=str(olivia.user.pk))
    assert (counter.cost_used, counter.cost_reserved) == (Decimal("3"), Decimal("0"))
    assert counter.period == spend.today()
    # at 80 %: one alert, emailed, and an audit entry; at 100 %: one more
    kinds = sorted(a.cause.rsplit(":", 1)[-1] for a in Alert.objects.filter(kind="spend_cap"))
    assert kinds == ["100", "80"]
    assert AuditEntry.objects.filter(action="spend.cap_warning").count() == 1
    assert any("Spend cap 80 % used" in mail.subject for mail in mailoutbox)

    # the dashboard shows what is left
    client.force_login(olivia.user)
    page = client.get("/").content.decode()
    assert "Spend caps" in page and "2 runs stopped" in page

    with pytest.raises(BudgetExhausted):
        spend.spend_top_up(scope="principal_day", subject="olivia", add_cost="0.1", actor=olivia)
    done = spend.spend_top_up(
        scope="principal_day", subject="olivia", add_cost="10", actor=olivia, reason="month end"
    )
    assert done.resumed == 2
    assert not SpendStop.objects.exists()
    for run in mine:
        run.refresh_from_db()
        assert (run.status, run.reason_code) == (Run.Status.QUEUED, "")
        assert events(run.id, "run.resumed")[-1].actor == "user:olivia"
    entry = AuditEntry.objects.get(action="spend.topped_up")
    assert entry.actor == "user:olivia" and Decimal(entry.after["max_cost"]) == Decimal("12.5")
    assert all(drive(run.id).status == Run.Status.SUCCEEDED for run in mine)


def test_a_viewer_may_not_set_caps_or_top_up(model_agent, viewer, olivia):
    victor = Actor.for_user(viewer, "web")
    with pytest.raises(PermissionDenied):
        spend.spend_cap_set(scope="global_day", max_cost="1", actor=victor)
    spend.spend_cap_set(scope="global_day", max_cost="1", actor=olivia)
    with pytest.raises(PermissionDenied):
        spend.spend_top_up(scope="global_day", add_cost="1", actor=victor)


def test_concurrent_calls_overshoot_a_cap_by_one_reservation_at_most(register, olivia):
    """Four runs' calls of a tool that declares a cost of 1 under a daily cap of 2.5: each
    call is dispatched while the ones before it are still in flight (reserved, not settled),
    so only the reservations keep the cap. Three go, the fourth run stops."""
    runs: list[Run] = []
    seen: list[Decimal] = []

    def in_flight(arguments, ctx):
        counter = SpendCounter.objects.get(scope="global_day")
        seen.append(counter.cost_reserved)
        nxt = arguments["n"] + 1
        if nxt < len(runs):
            engine.advance(runs[nxt].id, worker=f"w{nxt}")

    body = CountingTool(in_flight)
    register(
        Tool(
            name="paid_api",
            effect=Effect.IDEMPOTENT,
            call=body,
            timeout=1.0,
            max_cost=Decimal("1"),
        ),
        ScriptedAgent(
            "payer",
            lambda ctx: Finish({}) if ctx.steps else CallTool("paid_api", dict(ctx.input)),
            tools=("paid_api",),
        ),
    )
    spend.spend_cap_set(scope="global_day", max_cost="2.5", actor=olivia)
    runs.extend(run_create(agent_name="payer", input={"n": n}, actor=olivia) for n in range(4))

    engine.advance(runs[0].id, worker="w0")

    assert len(body.calls) == 3
    assert seen == [Decimal("1"), Decimal("2"), Decimal("3")]  # 0.5 over: one reservation
    stopped = Run.objects.get(id=runs[3].id)
    assert (stopped.status, stopped.reason_code) == (Run.Status.NEEDS_ATTENTION, "budget_exhausted")
    assert "all runs per day" in stopped.reason_detail
    for run in runs[:3]:
        assert drive(run.id).status == Run.Status.SUCCEEDED
    counter = SpendCounter.objects.get(scope="global_day")
    # settled at the receipts: used, nothing reserved any more
    assert (counter.cost_used, counter.cost_reserved) == (Decimal("3"), Decimal("0"))
    assert set(SpendReservation.objects.values_list("state", flat=True)) == {"settled"}


def test_a_model_request_cut_off_by_a_crash_stays_charged_until_an_operator_settles_it(
    model_agent, olivia
):
    model_agent.maximum = Usage(tokens=1000, cost=Decimal("0.5"))
    run = run_create(agent_name="thinker", actor=olivia)
    model_agent.plan["crash"] = True
    with pytest.raises(WorkerKilled):
        engine.advance(run.id, worker="w1")
    (held,) = SpendReservation.objects.filter(run_id=run.id)
    assert (held.kind, held.state) == ("model", "held")
    expire_lease(run.id)

    run = drive(run.id, worker="w2")

    assert run.status == Run.Status.SUCCEEDED
    held.refresh_from_db()
    assert held.state == "cut_off"
    (cut,) = events(run.id, "spend.cut_off")
    assert cut.payload["reservations"] == [held.pk] and cut.payload["tokens"] == 1000
    # the five decisions that were saved cost 1 each; the one cut off counts at its maximum
    assert run.cost_used == Decimal("5.5") and run.tokens_used == 1500
    others = SpendReservation.objects.filter(run_id=run.id).exclude(pk=held.pk)
    assert {r.state for r in others} == {"settled"}
    assert {r.cost_settled for r in others} == {Decimal("1")}

    nobody = Actor.for_user(_user_in_group_less(), "web")
    with pytest.raises(PermissionDenied):
        spend.spend_reservation_settle(reservation_id=held.pk, cost="0.2", tokens=400, actor=nobody)
    spend.spend_reservation_settle(reservation_id=held.pk, cost="0.2", tokens=400, actor=olivia)
    run.refresh_from_db()
    assert run.cost_used == Decimal("5.2") and run.tokens_used == 900
    (settled,) = events(run.id, "spend.settled")
    assert settled.actor == "user:olivia" and settled.payload["settled"]["tokens"] == 400


def _user_in_group_less():
    from django.contrib.auth import get_user_model

    return get_user_model().objects.create_user(username="nobody", password="pw")


def test_a_run_budget_counts_the_request_a_crash_cut_off(model_agent, olivia):
    """The run that lost 27 % of its spend: a request cut off by a crash is asked again,
    and its maximum counts against the run's own budget until it is settled."""
    model_agent.maximum = Usage(tokens=1000, cost=Decimal("0.5"))
    run = run_create(agent_name="thinker", actor=olivia, max_cost=Decimal("1.5"))
    run = drive(run.id)  # one decision (cost 1), then 1 < 1.5: one more ... until 2 >= 1.5
    assert (run.status, run.reason_code) == (Run.Status.NEEDS_ATTENTION, "budget_exhausted")
    assert run.cost_used == Decimal("2")

    run = run_create(agent_name="thinker", actor=olivia, max_cost=Decimal("1.2"))
    model_agent.plan["crash"] = True
    with pytest.raises(WorkerKilled):
        engine.advance(run.id, worker="w1")
    expire_lease(run.id)
    run = drive(run.id, worker="w2")
    # 0.5 cut off + 1 decided = 1.5 >= 1.2: stopped one decision earlier than without it
    assert (run.status, run.reason_code) == (Run.Status.NEEDS_ATTENTION, "budget_exhausted")
    assert run.cost_used == Decimal("1.5")


def test_dry_runs_are_not_counted_against_caps(model_agent, olivia):
    spend.spend_cap_set(scope="agent", subject="thinker", max_cost="0", actor=olivia)
    real = drive(run_create(agent_name="thinker", actor=olivia).id)
    assert (real.status, real.reason_code) == (Run.Status.NEEDS_ATTENTION, "budget_exhausted")
    assert "agent thinker" in real.reason_detail
    dry = drive(run_create(agent_name="thinker", actor=olivia, dry_run=True).id)
    assert dry.status == Run.Status.SUCCEEDED
    counter = SpendCounter.objects.get(scope="agent", subject="thinker")
    assert counter.cost_used == 0


def test_removing_a_cap_resumes_the_runs_it_stopped_and_metrics_show_spend(
    model_agent, olivia, client
):
    spend.spend_cap_set(scope="agent", subject="thinker", max_tokens=150, actor=olivia)
    run = drive(run_create(agent_name="thinker", actor=olivia).id)
    assert run.status == Run.Status.NEEDS_ATTENTION and run.tokens_used == 200

    samples = scrape(client)
    labels = {"scope": "agent", "subject": "thinker", "period": ""}
    assert value(samples, "agentops_spend_tokens_used", **labels) == 200
    assert value(samples, "agentops_spend_tokens_cap", **labels) == 150
    assert value(samples, "agentops_spend_tokens_reserved", **labels) == 0

    assert spend.spend_cap_remove(scope="agent", subject="thinker", actor=olivia)
    run.refresh_from_db()
    assert run.status == Run.Status.QUEUED
    assert drive(run.id).status == Run.Status.SUCCEEDED


def test_bad_caps_are_refused_with_the_field_named(model_agent, olivia):
    with pytest.raises(spend.InvalidCap) as unknown:
        spend.spend_cap_set(scope="agent", subject="nobody-here", max_cost="1", actor=olivia)
    assert "subject" in unknown.value.fields
    # neither maximum: the scope is only counted (shown, in /metrics), nothing stops
    counting = spend.spend_cap_set(scope="principal", subject="olivia", actor=olivia)
    assert (counting.max_cost, counting.max_tokens) == (None, None)
    with pytest.raises(spend.InvalidCap):
        spend.spend_cap_set(scope="eternity", max_cost="1", actor=olivia)
    with pytest.raises(spend.InvalidCap):
        spend.spend_cap_set(scope="global_day", max_cost="-1", actor=olivia)
    with pytest.raises(spend.CapNotFound):
        spend.spend_top_up(scope="agent", subject="thinker", add_cost="1", actor=olivia)


def test_the_demo_refunds_under_a_daily_cap_stop_and_a_top_up_resumes_them(sandbox, olivia):
    """Tried as a new user would: each refund costs the provider's fee (0.25, declared by
    the demo tool); a daily cap of 0.50 lets two through and stops the third with a clear
    reason; a top-up lets it finish."""
    spend.spend_cap_set(scope="principal_day", subject="olivia", max_cost="0.50", actor=olivia)
    runs = [
        run_create(
            agent_name="refund",
            input={"order_id": f"ord_100{n}", "amount_cents": 500},
            actor=olivia,
        )
        for n in (1, 2, 3)
    ]
    done = [drive(run.id) for run in runs]
    assert [run.status for run in done[:2]] == [Run.Status.SUCCEEDED] * 2
    stopped = done[2]
    assert (stopped.status, stopped.reason_code) == (Run.Status.NEEDS_ATTENTION, "budget_exhausted")
    assert stopped.reason_detail.startswith("spend cap reached: principal olivia per day")
    assert "cost 0.500000 of 0.500000" in stopped.reason_detail

    topped = spend.spend_top_up(
        scope="principal_day", subject="olivia", add_cost="0.25", actor=olivia
    )
    assert topped.resumed == 1
    assert drive(stopped.id).status == Run.Status.SUCCEEDED
    counter = SpendCounter.objects.get(scope="principal_day")
    assert (counter.cost_used, counter.cost_reserved) == (Decimal("0.75"), Decimal("0"))

"""The console in a real browser (issue 7): someone on call with the operator and approver
roles signs in, finds a run waiting for approval, approves it and watches it finish without
reloading, resolves an unknown outcome, and terminates a run with a reason.

Runs advance through the real engine: a ``runworker`` subprocess where the test watches a run
progress on its own, or ``drive`` in the test process to put a run in a known state first.
Screenshots of every page go to test-artifacts/browser/<database>/.
"""

from __future__ import annotations

import json
import re

import pytest
from django.core import mail
from django.urls import reverse

from agentops.demo import tools as demo_tools
from agentops.demo.sandbox import FAULT_HEADER
from approvals.models import Approval
from runs.actors import Actor
from runs.models import Question, Run, RunEvent, ToolCall, ToolReceipt
from runs.registry import ToolResult
from runs.services import run_create
from tests.browser.conftest import EXPECT_TIMEOUT_MS, PASSWORD, VIEWPORT, shot, sign_in
from tests.conftest import drive
from tests.runs.workerprocs import wait_for, worker_env
from tests.support import notifications, refunds, set_faults

pytestmark = [pytest.mark.browser, pytest.mark.slow, pytest.mark.django_db(transaction=True)]


def _expect():
    from playwright.sync_api import expect

    return expect


def _short(run: Run) -> str:
    return str(run.id)[:8]


def _no_reload_marker(page) -> None:
    """A value that lives only as long as this document: gone after any reload or
    navigation, so finding it later proves the page updated itself in place."""
    page.evaluate("window.__agentopsNoReload = 'still here'")


def _assert_not_reloaded(page) -> None:
    assert page.evaluate("window.__agentopsNoReload") == "still here"


def _refund_needing_approval() -> Run:
    # above the demo's 100.00 threshold: refund_payment asks an approver first. Started by
    # the system, not by oscar: nobody may approve a run they are the principal of.
    return run_create(
        agent_name="refund",
        goal="Refund order 1003: damaged in transit",
        input={"order_id": "ord_1003", "amount_cents": 11000, "reason": "damaged in transit"},
        actor=Actor.system("cli"),
    )


def test_sign_in_is_required_and_a_wrong_password_is_refused(page, console_user):
    expect = _expect()
    page.goto(reverse("runs:questions"))
    expect(page).to_have_url(re.compile(r"/accounts/login/"))

    page.get_by_label("Username").fill("oscar")
    page.get_by_label("Password").fill("not my password")
    page.get_by_role("button", name="Sign in").click()
    expect(page.get_by_role("alert")).to_contain_text("do not match")
    shot(page, "login-refused")

    page.get_by_label("Username").fill("oscar")
    page.get_by_label("Password").fill(PASSWORD)
    page.get_by_role("button", name="Sign in").click()
    # back to the page that asked for the sign-in, signed in
    expect(page).to_have_url(re.compile(reverse("runs:questions") + "$"))
    expect(page.locator("header")).to_contain_text("oscar")
    expect(page.get_by_role("button", name="Sign out")).to_be_visible()


def test_approving_a_refund_lets_it_finish_while_the_page_watches(
    page, console_user, sandbox, worker_procs
):
    expect = _expect()
    sign_in(page, "oscar")
    page.goto(reverse("runs:dashboard"))
    _no_reload_marker(page)
    waiting_card = page.locator("a.status-card", has_text="waiting_approval")
    expect(waiting_card.locator(".count")).to_have_text("0")

    run = _refund_needing_approval()
    worker = worker_procs.start("browser-w1", worker_env(sandbox))
    # the dashboard counts the run once the worker parks it on its approval, by itself
    expect(waiting_card.locator(".count")).to_have_text("1", timeout=90_000)
    _assert_not_reloaded(page)
    approval = Approval.objects.get(run=run)
    shot(page, "dashboard-waiting-approval", doc="dashboard")

    waiting_card.click()
    expect(page).to_have_url(re.compile(r"status=waiting_approval"))
    page.get_by_role("link", name=_short(run)).click()
    expect(page).to_have_url(re.compile(reverse("runs:detail", args=[run.id])))
    expect(page.locator("#run-summary .badge").first).to_have_text("waiting_approval")
    page.get_by_role("link", name=f"approval #{approval.id}").click()

    expect(page.get_by_role("heading", name=re.compile("refund_payment"))).to_be_visible()
    shot(page, "approval-detail", doc="approval-detail")
    page.get_by_role("button", name="Approve", exact=True).click()
    expect(page.get_by_text("You approved this call.")).to_be_visible()

    page.goto(reverse("runs:detail", args=[run.id]))
    _no_reload_marker(page)
    # the worker picks the approved call up and finishes; the page polls its way there
    expect(page.locator("#run-summary .badge").first).to_have_text("succeeded", timeout=90_000)
    _assert_not_reloaded(page)
    shot(page, "run-detail-succeeded", doc="run-detail")
    assert worker.alive, worker.output()

    run.refresh_from_db()
    assert run.status == Run.Status.SUCCEEDED
    approval.refresh_from_db()
    assert approval.status == Approval.Status.APPROVED
    decided = RunEvent.objects.get(run=run, type="approval.decided")
    assert (decided.actor, decided.channel) == ("user:oscar", "web")


def test_a_panel_refresh_copies_no_style_the_policy_would_block(page, console_user):
    # Script may style an element through the CSSOM, which the Content-Security-Policy
    # allows: a browser extension, or Playwright hiding the caret while it takes a
    # screenshot. When htmx swaps in the refreshed panel it must not copy such a style onto
    # the new elements as a style attribute: the policy blocks that and reports it on the
    # console (which fails any test here, in the page fixture).
    expect = _expect()
    run = _refund_needing_approval()
    sign_in(page, "oscar")
    page.goto(reverse("runs:detail", args=[run.id]))
    expect(page.locator("#run-actions #id_pause_reason")).to_be_attached()
    page.evaluate(
        """() => {
        const panel = document.getElementById("run-actions");
        panel.dataset.before = "refresh";
        panel.querySelectorAll("[id]").forEach((element) => {
            element.style.setProperty("caret-color", "transparent", "important");
        });
        htmx.trigger(document.body, "run-actions-changed");
    }"""
    )

    # swapped in and settled; the page fixture then finds no CSP report on the console
    refreshed = page.locator("#run-actions:not([data-before])")
    expect(refreshed.locator("#id_pause_reason")).to_be_attached()
    expect(refreshed).not_to_have_class(re.compile("htmx-settling"))


def test_the_approvals_inbox_lists_what_waits_for_a_decision(page, console_user, sandbox):
    expect = _expect()
    run = drive(_refund_needing_approval().id)
    assert run.status == Run.Status.WAITING_APPROVAL

    sign_in(page, "oscar")
    page.get_by_role("navigation", name="Main").get_by_role("link", name="Approvals").click()
    pending = page.locator("#inbox tr", has_text=_short(run))
    expect(pending).to_contain_text("refund_payment")
    expect(pending).to_contain_text("ord_1003")
    shot(page, "approvals-inbox", doc="approvals")
    pending.get_by_role("link", name="refund_payment").click()
    expect(page.get_by_role("heading", name=re.compile("refund_payment"))).to_be_visible()


def followup_with_a_lost_notification(
    monkeypatch, sandbox, principal
) -> tuple[Run, ToolCall, dict]:
    """A follow-up run whose notification the sandbox recorded but whose response was lost:
    an unsafe tool's unknown outcome, which always goes to a person. Returns the run (in
    ``needs_attention``), the call, and the notification as the sandbox recorded it."""

    def send_and_lose_response(arguments, ctx):
        response = demo_tools._request(
            "POST",
            "/notifications",
            timeout=ctx.timeout,
            json=dict(arguments),
            headers={FAULT_HEADER: "drop"},
        )
        return ToolResult(result=response.json())

    monkeypatch.setattr(demo_tools.SEND_NOTIFICATION, "call", send_and_lose_response)
    run = run_create(
        agent_name="followup",
        goal="Tell the customer of order 1002 about the refund",
        input={"order_id": "ord_1002", "message": "Your refund is on its way."},
        actor=Actor.for_user(principal, "cli"),
    )
    run = drive(run.id)
    assert (run.status, run.reason_code) == (Run.Status.NEEDS_ATTENTION, "unknown_outcome")
    call = ToolCall.objects.get(run=run, tool_name="send_notification")
    (sent,) = notifications(sandbox)
    return run, call, sent


def test_resolving_an_unknown_outcome_from_the_inbox(page, console_user, sandbox, monkeypatch):
    expect = _expect()
    run, call, sent = followup_with_a_lost_notification(monkeypatch, sandbox, console_user)

    sign_in(page, "oscar")
    page.goto(reverse("runs:dashboard"))
    # "what needs me now?": the call is on the dashboard, one click from its resolution
    page.get_by_role(
        "link", name=f"Resolve the unknown outcome of send_notification (call #{call.step.seq})"
    ).click()
    expect(page).to_have_url(re.compile(reverse("runs:unknown")))
    row = page.locator(f"#call-{call.id}")
    expect(row).to_contain_text("send_notification")
    expect(row).to_contain_text(call.idempotency_key)
    expect(row.get_by_role("note")).to_contain_text("Unsafe tool")
    shot(page, "unknown-outcomes", doc="unknown")

    row.get_by_label("External reference").fill(sent["notification_id"])
    row.get_by_label("Result as JSON (optional)").fill(
        json.dumps({"notification_id": sent["notification_id"]})
    )
    row.get_by_role("button", name="Mark as happened").click()
    expect(row).to_contain_text(re.compile(r"is now\s+succeeded"))
    shot(page, "unknown-outcome-resolved")

    call.refresh_from_db()
    assert call.status == ToolCall.Status.SUCCEEDED
    receipt = ToolReceipt.objects.get(tool_call=call)
    assert (receipt.source, receipt.external_ref) == ("operator", sent["notification_id"])
    resolved = RunEvent.objects.get(run=run, type="tool.resolved")
    assert (resolved.actor, resolved.channel) == ("user:oscar", "web")
    # the run goes on from the person's receipt and never sends the message again
    run = drive(run.id)
    assert run.status == Run.Status.SUCCEEDED, (run.reason_code, run.reason_detail)
    assert run.result["notification_id"] == sent["notification_id"]
    assert len(notifications(sandbox)) == 1

    page.goto(reverse("runs:detail", args=[run.id]))
    expect(page.locator("#run-timeline")).to_contain_text("resolved as")
    expect(page.locator("#run-timeline")).to_contain_text("user:oscar")


def _onboarding_waiting(user, customer: str = "Acme") -> Run:
    """The demo onboarding agent asks the operators a question and waits, holding nothing."""
    run = run_create(
        agent_name="onboarding",
        goal=f"Onboard {customer}",
        input={"customer": customer},
        actor=Actor.for_user(user, "cli"),
    )
    run = drive(run.id)
    assert run.status == Run.Status.WAITING_EVENT
    return run


def test_terminating_a_run_needs_a_reason_that_then_shows_in_the_timeline(page, console_user):
    expect = _expect()
    run = _onboarding_waiting(console_user)

    sign_in(page, "oscar")
    page.goto(reverse("runs:detail", args=[run.id]))
    expect(page.locator("#run-summary .badge").first).to_have_text("waiting_event")
    shot(page, "run-detail-waiting")
    page.get_by_text("Terminate", exact=True).click()
    reason = page.get_by_label("Reason (recorded in the timeline)")
    expect(reason).to_be_visible()
    # the browser itself refuses an empty reason (required), before any request
    page.get_by_label(re.compile("I understand")).check()
    page.get_by_role("button", name="Terminate run").click()
    assert Run.objects.get(id=run.id).status == Run.Status.WAITING_EVENT

    reason.fill("Customer cancelled the contract before onboarding")
    page.get_by_role("button", name="Terminate run").click()

    expect(page.locator("#run-summary .badge").first).to_have_text("terminated")
    timeline = page.locator("#run-timeline")
    expect(timeline).to_contain_text(
        "terminated by user:oscar: Customer cancelled the contract before onboarding"
    )
    shot(page, "run-detail-terminated")
    run.refresh_from_db()
    assert (run.status, run.reason_code) == (Run.Status.TERMINATED, "operator_terminated")
    terminated = RunEvent.objects.get(run=run, type="run.terminated")
    assert (terminated.actor, terminated.channel) == ("user:oscar", "web")
    assert Question.objects.get(run=run).status == Question.Status.CANCELLED


def test_answering_a_question_in_the_console_lets_the_worker_continue(
    page, console_user, worker_procs
):
    expect = _expect()
    worker = worker_procs.start("browser-w2", worker_env())
    run = run_create(
        agent_name="onboarding",
        goal="Onboard Acme",
        input={"customer": "Acme"},
        actor=Actor.for_user(console_user, "cli"),
    )
    question = wait_for(
        lambda: Question.objects.filter(run=run).first(), 60, what="the question to be asked"
    )

    sign_in(page, "oscar")
    page.goto(reverse("runs:questions"))
    expect(page.get_by_text("Which plan should Acme start on?")).to_be_visible()
    shot(page, "questions-inbox", doc="questions")
    page.get_by_role("link", name=re.compile("Which plan should Acme start on")).first.click()
    page.get_by_label("pro", exact=True).check()
    shot(page, "question-detail")
    page.get_by_role("button", name="Answer").click()
    expect(page.get_by_text("Your answer was recorded")).to_be_visible()

    # the worker resumes the agent with the answer; it then waits for the payment signal
    wait_for(
        lambda: Run.objects.get(id=run.id).state.get("plan") == "pro",
        60,
        what="the worker to continue with the answer",
    )
    assert worker.alive, worker.output()
    question.refresh_from_db()
    assert (question.answer, question.answered_by, question.channel) == (
        "pro",
        console_user,
        "web",
    )


def test_an_emailed_question_link_answers_once_its_recipient_signs_in(page, console_user):
    expect = _expect()
    run = _onboarding_waiting(console_user)  # the test's commit sends the emails
    (message,) = [m for m in mail.outbox if "oscar@example.com" in m.to]
    path = re.search(r"/questions/link/[A-Za-z0-9_-]+/", message.body).group(0)

    page.goto(path)  # the link alone answers nothing in oscar's name
    expect(page.get_by_role("heading", name="Sign in to answer")).to_be_visible()
    page.get_by_role("link", name="Sign in as oscar").click()
    page.get_by_label("Username").fill("oscar")
    page.get_by_label("Password").fill(PASSWORD)
    page.get_by_role("button", name="Sign in").click()
    # back on the link, signed in
    expect(page.get_by_role("heading", name="Which plan should Acme start on?")).to_be_visible()
    shot(page, "question-link", doc="question-link")
    assert Question.objects.get(run=run).status == Question.Status.OPEN  # opening is not answering
    page.get_by_label("enterprise").check()
    page.get_by_role("button", name="Answer").click()

    expect(page.get_by_role("heading", name="This question has been answered")).to_be_visible()
    expect(page.get_by_text("cannot be used again")).to_be_visible()
    question = Question.objects.get(run=run)
    assert (question.answer, question.answered_by, question.channel) == (
        "enterprise",
        console_user,
        "email",
    )


def test_the_runs_list_filters_and_terminates_runs_in_bulk(page, console_user, sandbox):
    expect = _expect()
    acme = _onboarding_waiting(console_user, "Acme")
    globex = _onboarding_waiting(console_user, "Globex")
    initech = _onboarding_waiting(console_user, "Initech")
    refunded = drive(
        run_create(
            agent_name="refund",
            goal="Refund order 1002: late delivery",
            input={"order_id": "ord_1002", "amount_cents": 500},
            actor=Actor.for_user(console_user, "cli"),
        ).id
    )
    assert refunded.status == Run.Status.SUCCEEDED

    sign_in(page, "oscar")
    page.goto(reverse("runs:list"))
    rows = page.locator("#runs-table tbody tr")
    expect(rows).to_have_count(4)
    shot(page, "runs-list", doc="runs")

    page.get_by_label("Search").fill("Globex")
    page.get_by_role("button", name="Filter").click()
    expect(rows).to_have_count(1)
    expect(rows.first).to_contain_text(_short(globex))
    page.get_by_role("link", name="Clear").click()
    expect(rows).to_have_count(4)

    for run in (acme, initech, refunded):
        page.get_by_label(f"Select run {_short(run)}").check()
    page.get_by_label("Reason").fill("Duplicate onboarding requests")
    page.once("dialog", lambda dialog: dialog.accept())  # "Terminate 3 selected run(s)?"
    page.get_by_role("button", name="Terminate selected").click()

    results = page.locator("#bulk-results")
    expect(results.locator(f'[data-run="{acme.id}"]')).to_contain_text("done")
    expect(results.locator(f'[data-run="{initech.id}"]')).to_contain_text("done")
    # one run refusing does not stop the others, and says why
    expect(results.locator(f'[data-run="{refunded.id}"]')).to_contain_text("refused")
    shot(page, "runs-bulk-terminated")
    for run in (acme, initech):
        run.refresh_from_db()
        assert (run.status, run.reason_code) == (Run.Status.TERMINATED, "operator_terminated")
        terminated = RunEvent.objects.get(run=run, type="run.terminated")
        assert terminated.actor == "user:oscar"
        assert terminated.payload["reason"] == "Duplicate onboarding requests"
    assert Run.objects.get(id=globex.id).status == Run.Status.WAITING_EVENT
    assert Run.objects.get(id=refunded.id).status == Run.Status.SUCCEEDED


def test_the_timeline_tells_how_a_killed_worker_was_taken_over(
    page, console_user, sandbox, worker_procs
):
    expect = _expect()
    set_faults(sandbox, latency_ms=1500)  # the refund is in flight when the worker dies
    run = run_create(
        agent_name="refund",
        goal="Refund order 1002: late delivery",
        input={"order_id": "ord_1002", "amount_cents": 500},
        actor=Actor.system("cli"),
    )
    first = worker_procs.start("w-2", worker_env(sandbox))
    wait_for(
        lambda: ToolCall.objects.filter(
            run=run, tool_name="refund_payment", status=ToolCall.Status.DISPATCHING
        ).exists(),
        60,
        what="the refund to be dispatched",
    )
    first.kill_group()
    second = worker_procs.start("w-5", worker_env(sandbox))

    sign_in(page, "oscar")
    page.goto(reverse("runs:detail", args=[run.id]))
    _no_reload_marker(page)
    # w-5 takes over once w-2's lease expires, finds the refund by its key and finishes
    expect(page.locator("#run-summary .badge").first).to_have_text("succeeded", timeout=90_000)
    # the timeline followed along: new events make the page reload it in place
    timeline = page.locator("#run-timeline")
    expect(timeline).to_contain_text("w-2 lost its lease at")
    expect(timeline).to_contain_text("w-5 took over after a lost lease")
    expect(timeline).to_contain_text("run.succeeded")
    _assert_not_reloaded(page)
    page.locator(".tl-lost").first.scroll_into_view_if_needed()
    shot(page, "run-timeline-takeover", doc="timeline")
    assert second.alive, second.output()
    assert [r["idempotency_key"] for r in refunds(sandbox)] == [f"{run.id}:2"]  # refunded once


@pytest.fixture
def page_without_javascript(chromium, live_server):
    """The console's forms must work with JavaScript off (plain POST and redirect)."""
    context = chromium.new_context(
        base_url=live_server.url, viewport=VIEWPORT, java_script_enabled=False, timezone_id="UTC"
    )
    context.set_default_timeout(EXPECT_TIMEOUT_MS)
    yield context.new_page()
    context.close()


def test_starting_and_terminating_a_run_work_without_javascript(
    page_without_javascript, console_user
):
    expect = _expect()
    page = page_without_javascript
    sign_in(page, "oscar")
    page.goto(reverse("runs:start"))
    page.get_by_label("Agent").select_option("onboarding")
    page.get_by_label("Goal").fill("Onboard Initech")
    page.get_by_label("Input (JSON)").fill('{"customer": ""}')  # the schema wants 1+ characters
    page.get_by_role("button", name="Start the run").click()
    expect(page.locator(".errorlist")).to_be_visible()
    assert not Run.objects.filter(goal="Onboard Initech").exists()
    shot(page, "start-run-refused", doc="start")

    page.get_by_label("Input (JSON)").fill('{"customer": "Initech"}')
    page.get_by_role("button", name="Start the run").click()

    run = Run.objects.get(goal="Onboard Initech")
    expect(page).to_have_url(re.compile(reverse("runs:detail", args=[run.id])))
    assert run.principal == console_user
    assert RunEvent.objects.get(run=run, type="run.created").actor == "user:oscar"

    page.get_by_text("Terminate", exact=True).click()  # a <details>: opens without script
    page.get_by_label("Reason (recorded in the timeline)").fill("Started by mistake")
    page.get_by_label(re.compile("I understand")).check()
    page.get_by_role("button", name="Terminate run").click()

    expect(page.locator("#run-summary .badge").first).to_have_text("terminated")
    expect(page.locator("#run-timeline")).to_contain_text(
        "terminated by user:oscar: Started by mistake"
    )
    run.refresh_from_db()
    assert (run.status, run.reason_code) == (Run.Status.TERMINATED, "operator_terminated")


def test_an_emailed_approval_link_approves_in_the_browser(page, console_user, sandbox):
    expect = _expect()
    run = drive(_refund_needing_approval().id)  # the test's commit sends the emails
    (message,) = [m for m in mail.outbox if "oscar@example.com" in m.to]
    path = re.search(r"/approvals/link/[A-Za-z0-9_-]+/", message.body).group(0)

    page.goto(path)
    expect(page.get_by_role("heading", name=re.compile("Approve"))).to_be_visible()
    assert (
        Approval.objects.get(run=run).status == Approval.Status.PENDING
    )  # opening decides nothing
    # a link decides for its recipient, signed in (DESIGN §9): sign in, come back, decide
    page.get_by_role("link", name="Sign in to decide").click()
    page.get_by_label("Username").fill("oscar")
    page.get_by_label("Password").fill(PASSWORD)
    page.get_by_role("button", name="Sign in").click()
    page.wait_for_url(lambda url: "/approvals/link/" in url)
    page.get_by_label(re.compile("I have read the request")).check()
    page.get_by_role("button", name="Approve").click()

    expect(page.get_by_role("heading", name="This approval has been decided")).to_be_visible()
    approval = Approval.objects.get(run=run)
    assert approval.status == Approval.Status.APPROVED
    decided = RunEvent.objects.get(run=run, type="approval.decided")
    assert (decided.actor, decided.channel) == ("user:oscar", "email")


PHONE = {"width": 390, "height": 844}
# the innermost elements that stick out past the right edge: what to fix
WIDEST_ELEMENTS = """
() => {
  const edge = document.documentElement.clientWidth;
  const out = [...document.querySelectorAll("body *")].filter(
    (el) => el.getBoundingClientRect().right > edge + 1
      && ![...el.children].some((c) => c.getBoundingClientRect().right > edge + 1)
  );
  return out.slice(0, 5).map((el) => {
    const name = el.tagName.toLowerCase() + (el.className ? "." + el.className : "");
    return name + " +" + Math.round(el.getBoundingClientRect().right - edge) + "px";
  });
}
"""


def test_every_page_fits_a_phone_screen(chromium, live_server, console_user, sandbox):
    """Readable at phone width: no page scrolls sideways (wide tables scroll inside their
    own box instead)."""
    run = _onboarding_waiting(console_user)
    approval_run = drive(_refund_needing_approval().id)
    approval = Approval.objects.get(run=approval_run)
    context = chromium.new_context(
        base_url=live_server.url,
        viewport=PHONE,
        is_mobile=True,
        has_touch=True,
        timezone_id="UTC",
    )
    context.set_default_timeout(EXPECT_TIMEOUT_MS)
    try:
        page = context.new_page()
        sign_in(page, "oscar")
        pages = {
            "dashboard": reverse("runs:dashboard"),
            "runs": reverse("runs:list"),
            "start": reverse("runs:start"),
            "run-detail": reverse("runs:detail", args=[run.id]),
            "unknown": reverse("runs:unknown"),
            "approvals": reverse("approvals:inbox"),
            "approval-detail": reverse("approvals:detail", args=[approval.id]),
            "questions": reverse("runs:questions"),
            "question": reverse("runs:question", args=[Question.objects.get(run=run).id]),
        }
        too_wide = {}
        for name, path in pages.items():
            page.goto(path)
            page.wait_for_load_state("networkidle")
            overflow = page.evaluate(
                "document.documentElement.scrollWidth - document.documentElement.clientWidth"
            )
            shot(page, f"phone-{name}")
            if overflow > 1:
                too_wide[name] = page.evaluate(WIDEST_ELEMENTS)
        assert not too_wide, f"pages wider than a {PHONE['width']}px phone: {too_wide}"
    finally:
        context.close()


def test_a_scanner_that_opens_a_link_and_submits_every_form_decides_nothing(
    page, console_user, sandbox
):
    run = drive(_refund_needing_approval().id)
    (message,) = [m for m in mail.outbox if "oscar@example.com" in m.to]
    path = re.search(r"/approvals/link/[A-Za-z0-9_-]+/", message.body).group(0)

    page.goto(path)
    # what a link-checking headless browser does: submit whatever forms the page has
    page.evaluate("document.querySelectorAll('form').forEach((form) => form.submit())")
    page.wait_for_load_state()
    page.goto(path)

    assert Approval.objects.get(run=run).status == Approval.Status.PENDING
    # even in the recipient's own signed-in browser, a form sent as it is decides nothing
    sign_in(page, "oscar")
    page.goto(path)
    page.evaluate(
        "document.querySelectorAll('form.decide button[value=approve]').forEach("
        "(button) => button.click())"
    )
    page.wait_for_load_state()

    assert Approval.objects.get(run=run).status == Approval.Status.PENDING
    assert not RunEvent.objects.filter(run=run, type="approval.decided").exists()

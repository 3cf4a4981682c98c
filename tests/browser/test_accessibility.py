"""Accessibility (issue 21): axe-core, the npm package vendored in tests/browser/vendor/,
runs in Chromium on every console page and finds no serious or critical violation; the
disclosures that hold actions are reachable by role."""

from __future__ import annotations

from pathlib import Path

import pytest
from django.urls import reverse

from approvals.models import Approval
from runs.models import Question
from tests.browser.conftest import EXPECT_TIMEOUT_MS, VIEWPORT, sign_in
from tests.browser.test_console import _onboarding_waiting, _refund_needing_approval
from tests.conftest import drive

pytestmark = [pytest.mark.browser, pytest.mark.django_db(transaction=True)]

AXE = (Path(__file__).parent / "vendor" / "axe.min.js").read_text()
# WCAG 2.1 A and AA, and axe's best practices
RUN_AXE = """async () => {
  const result = await axe.run(document, {
    runOnly: {type: "tag", values: ["wcag2a", "wcag2aa", "wcag21a", "wcag21aa", "best-practice"]},
    resultTypes: ["violations"],
  });
  return result.violations
    .filter((v) => v.impact === "serious" || v.impact === "critical")
    .map((v) => ({id: v.id, impact: v.impact, help: v.help,
                  nodes: v.nodes.slice(0, 3).map((n) => n.target.join(" ") + " :: " + (n.any[0] && n.any[0].message || "").slice(0, 200))}));
}"""


def test_no_page_has_a_serious_or_critical_axe_violation(
    chromium, live_server, console_user, sandbox
):
    run = _onboarding_waiting(console_user)
    approval_run = drive(_refund_needing_approval().id)
    approval = Approval.objects.get(run=approval_run)
    # axe is injected as a script: the pages' Content-Security-Policy (script-src 'self')
    # would refuse it, so this context alone bypasses the policy (test_console checks it)
    context = chromium.new_context(
        base_url=live_server.url, viewport=VIEWPORT, timezone_id="UTC", bypass_csp=True
    )
    context.set_default_timeout(EXPECT_TIMEOUT_MS)
    try:
        page = context.new_page()
        page.goto(reverse("login"))
        found = {"sign-in": _violations(page)}
        sign_in(page, "oscar")
        pages = {
            "dashboard": reverse("runs:dashboard"),
            "runs": reverse("runs:list") + "?reason=unknown_outcome",
            "start": reverse("runs:start"),
            "run-detail": reverse("runs:detail", args=[approval_run.id]),
            "run-detail-waiting": reverse("runs:detail", args=[run.id]),
            "events": reverse("runs:event_list"),
            "unknown": reverse("runs:unknown"),
            "unknown-triage": reverse("runs:unknown_triage"),
            "approvals": reverse("approvals:inbox"),
            "approval-detail": reverse("approvals:detail", args=[approval.id]),
            "questions": reverse("runs:questions"),
            "question": reverse("runs:question", args=[Question.objects.get(run=run).id]),
        }
        for name, path in pages.items():
            page.goto(path)
            page.wait_for_load_state("networkidle")
            found[name] = _violations(page)
        serious = {name: violations for name, violations in found.items() if violations}
        assert not serious, f"serious or critical accessibility violations: {serious}"
    finally:
        context.close()


def _violations(page) -> list[dict]:
    page.add_script_tag(content=AXE)
    return page.evaluate(RUN_AXE)


def test_actions_in_disclosures_are_reachable_by_role(page, console_user, sandbox):
    from playwright.sync_api import expect

    run = _onboarding_waiting(console_user)
    sign_in(page, "oscar")
    page.goto(reverse("runs:detail", args=[run.id]))

    page.get_by_role("button", name="Top up the budget").click()
    expect(page.get_by_label("Add steps")).to_be_visible()
    page.get_by_role("button", name="Terminate", exact=True).click()
    expect(page.get_by_role("button", name="Terminate run")).to_be_visible()


def test_the_approval_pages_disclosures_are_reachable_by_role(page, console_user, sandbox):
    from playwright.sync_api import expect

    approval = Approval.objects.get(run=drive(_refund_needing_approval().id))
    sign_in(page, "oscar")
    page.goto(reverse("approvals:detail", args=[approval.id]))

    page.get_by_role("button", name="Approve with edited arguments").click()
    expect(page.get_by_role("button", name="Approve with these arguments")).to_be_visible()
    page.get_by_role("button", name="Comment without deciding").click()
    expect(page.get_by_role("button", name="Comment", exact=True)).to_be_visible()

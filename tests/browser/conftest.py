"""Browser fixtures: Debian's Chromium driven by Playwright against pytest-django's
``live_server``, with real ``runworker`` processes advancing runs in the background.

Chromium comes from the system (``/usr/bin/chromium``, installed by ``.ci/run``): Playwright
cannot download a browser on these machines. Without it the tests skip on a developer's
machine, but fail when ``CI`` or ``AGENTOPS_REQUIRE_BROWSER=1`` is set: a CI run that
silently skipped the only end-to-end check of the console would prove nothing.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from django.conf import settings
from django.db import connection
from django.urls import reverse

CHROMIUM = os.environ.get("AGENTOPS_CHROMIUM", "/usr/bin/chromium")
LAUNCH_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
    "--disable-quic",
]
VIEWPORT = {"width": 1280, "height": 800}
ARTIFACTS = Path(settings.BASE_DIR) / "test-artifacts" / "browser"
DOC_IMAGES = Path(settings.BASE_DIR) / "docs" / "img"
# generous: the pages poll every few seconds and the worker shares two cores with others
EXPECT_TIMEOUT_MS = 45_000

PASSWORD = "correct horse battery staple"

# Every Content-Security-Policy violation as a console error with what Chromium's own line
# leaves out: the directive, the script and line that caused it, the element it was about (a
# blocked style attribute shows in its HTML) and the blocked sample (given only where the
# directive has 'report-sample').
CSP_VIOLATION_LISTENER = """
document.addEventListener("securitypolicyviolation", (event) => {
  const target = event.target;
  console.error("CSP violation: " + JSON.stringify({
    directive: event.violatedDirective,
    source: `${event.sourceFile}:${event.lineNumber}:${event.columnNumber}`,
    element: target instanceof Element ? target.outerHTML.slice(0, 300) : String(target),
    blocked: event.blockedURI,
    sample: event.sample,
  }));
});
"""


def _browser_required() -> bool:
    return bool(os.environ.get("CI")) or os.environ.get("AGENTOPS_REQUIRE_BROWSER") == "1"


def _unavailable(why: str) -> None:
    if _browser_required():
        pytest.fail(
            f"browser tests are required here (CI / AGENTOPS_REQUIRE_BROWSER=1) but {why}",
            pytrace=False,
        )
    pytest.skip(why)


@pytest.fixture(scope="module")
def chromium() -> Iterator[Any]:
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        _unavailable("playwright is not installed (pip install -e '.[dev]')")
    if not os.access(CHROMIUM, os.X_OK):
        _unavailable(f"{CHROMIUM} is missing (apt-get install -y chromium)")
    from playwright.sync_api import expect

    expect.set_options(timeout=EXPECT_TIMEOUT_MS)
    with pytest.MonkeyPatch.context() as patch, sync_playwright() as playwright:
        # Playwright's sync API keeps an asyncio loop on the test's thread for as long as it
        # runs; Django would take every ORM call on that thread (the tests', the database
        # flush between them) for a call from async code and refuse it. They are ordinary
        # synchronous calls. Only while the browser runs, so no other test loses the check.
        patch.setenv("DJANGO_ALLOW_ASYNC_UNSAFE", "true")
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=LAUNCH_ARGS)
        yield browser
        browser.close()


@pytest.fixture
def page(chromium, live_server, request) -> Iterator[Any]:
    """A fresh browser context (no cookies) on the live server, in a fixed timezone so the
    screenshots and the times on the pages do not depend on the machine."""
    context = chromium.new_context(
        base_url=live_server.url, viewport=VIEWPORT, timezone_id="UTC", locale="en-US"
    )
    context.set_default_timeout(EXPECT_TIMEOUT_MS)
    context.add_init_script(CSP_VIOLATION_LISTENER)
    browser_page = context.new_page()
    errors: list[str] = []
    browser_page.on("pageerror", lambda exc: errors.append(f"{browser_page.url}: {exc}"))

    def on_console(message) -> None:
        # console errors include what the Content-Security-Policy blocked (an inline script
        # or style, with the details above) and failed loads of the pages' own scripts and
        # stylesheets
        if message.type == "error":
            errors.append(f"{browser_page.url}: {message.text}")

    browser_page.on("console", on_console)
    yield browser_page
    if getattr(request.node, "rep_call", None) is not None and request.node.rep_call.failed:
        shot(browser_page, f"FAILED-{request.node.name}")
    context.close()
    # a JavaScript error or a CSP violation on any page is a bug even when the assertions
    # happened to pass
    assert not errors, f"errors in the browser console: {errors}"


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(item, call):
    report = yield
    if report.when == "call":
        item.rep_call = report
    return report


def shot(page: Any, name: str, *, doc: str = "") -> Path:
    """Save a screenshot under test-artifacts/browser/<database>/. With
    ``AGENTOPS_DOC_SCREENSHOTS=1`` a ``doc`` name also refreshes docs/img/console-<doc>.png
    (the pictures in docs/console.md)."""
    folder = ARTIFACTS / connection.vendor
    folder.mkdir(parents=True, exist_ok=True)
    safe = re.sub(r"[^A-Za-z0-9_.-]+", "-", name)[:120]
    path = folder / f"{safe}.png"
    page.screenshot(path=str(path), full_page=False)
    # a template tag or comment the engine did not parse (a "{# #}" comment spans one line
    # only) shows up as text on the page. ("}}" is left out: nested JSON on a page ends so.)
    text = page.locator("body").inner_text()
    leaked = [marker for marker in ("{#", "#}", "{%", "%}", "{{") if marker in text]
    assert not leaked, f"template syntax shown as text on {page.url}: {leaked}"
    if doc and os.environ.get("AGENTOPS_DOC_SCREENSHOTS") == "1":
        DOC_IMAGES.mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(DOC_IMAGES / f"console-{doc}.png"), full_page=False)
    return path


def sign_in(page: Any, username: str, password: str = PASSWORD) -> None:
    """Through the login page, as a person would."""
    page.goto(reverse("login"))
    page.get_by_label("Username").fill(username)
    page.get_by_label("Password").fill(password)
    page.get_by_role("button", name="Sign in").click()
    page.wait_for_url(lambda url: "/accounts/login/" not in url)


@pytest.fixture
def console_user(roles, django_user_model):
    """Someone on call: operator and approver, with an email address."""
    from django.contrib.auth.models import Group

    user = django_user_model.objects.create_user(
        username="oscar", password=PASSWORD, email="oscar@example.com"
    )
    user.groups.add(*Group.objects.filter(name__in=["operator", "approver"]))
    return user

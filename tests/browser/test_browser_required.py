"""Without Chromium the browser tests skip on a developer's machine, but fail in CI: a CI run
that silently skipped the only end-to-end check of the console would prove nothing."""

from __future__ import annotations

import pytest

from tests.browser import conftest


@pytest.fixture
def no_ci(monkeypatch):
    monkeypatch.delenv("CI", raising=False)
    monkeypatch.delenv("AGENTOPS_REQUIRE_BROWSER", raising=False)
    return monkeypatch


def test_a_missing_browser_skips_outside_ci(no_ci):
    with pytest.raises(pytest.skip.Exception, match="chromium is missing"):
        conftest._unavailable("/usr/bin/chromium is missing")


@pytest.mark.parametrize(("name", "value"), [("CI", "true"), ("AGENTOPS_REQUIRE_BROWSER", "1")])
def test_a_missing_browser_fails_when_the_browser_tests_are_required(no_ci, name, value):
    no_ci.setenv(name, value)

    with pytest.raises(pytest.fail.Exception, match="required here"):
        conftest._unavailable("/usr/bin/chromium is missing")

"""Swagger UI (``/api/docs/``) in a real browser under the strict Content-Security-Policy:
it renders the API's operations, and the ``page`` fixture fails the test on any console
error — which is where the browser reports what the policy blocked (inline script or style,
``eval``)."""

from __future__ import annotations

import pytest

pytestmark = [pytest.mark.browser, pytest.mark.slow, pytest.mark.django_db(transaction=True)]


def test_swagger_ui_renders_the_api_under_the_content_security_policy(page):
    response = page.goto("/api/docs/")

    assert "script-src 'self'" in response.headers["content-security-policy"]
    page.locator(".swagger-ui .info .title").wait_for()
    assert page.locator(".swagger-ui .info .title").inner_text().startswith("agentops API")
    assert page.locator(".opblock").count() > 10
    # the page styles moved out of the template still apply (static/css/swagger.css)
    assert page.evaluate("getComputedStyle(document.body).margin") == "0px"

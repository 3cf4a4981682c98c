"""System checks (``manage.py check --deploy``): settings that only a deployment reveals."""

from __future__ import annotations

from typing import Any
from urllib.parse import urlsplit

from django.conf import settings
from django.core.checks import Error, Tags, Warning, register

# backends that deliver nothing to anyone: their links are never opened
NON_SENDING = {
    "django.core.mail.backends.console.EmailBackend",
    "django.core.mail.backends.locmem.EmailBackend",
    "django.core.mail.backends.dummy.EmailBackend",
    "django.core.mail.backends.filebased.EmailBackend",
}


@register(Tags.security, deploy=True)
def base_url_check(app_configs: Any = None, **kwargs: Any) -> list:
    """Every emailed link (approvals, questions, alerts) starts with ``AGENTOPS_BASE_URL``:
    without it, or with a wrong one, people receive links that lead nowhere."""
    base = settings.AGENTOPS.get("BASE_URL", "")
    sends_email = settings.EMAIL_BACKEND not in NON_SENDING
    if not base:
        if not sends_email:
            return []
        return [
            Error(
                f"AGENTOPS_BASE_URL is not set, but email is sent ({settings.EMAIL_BACKEND}): "
                "the links in approval, question and alert emails would lead nowhere.",
                hint="Set AGENTOPS_BASE_URL to the address people open the console at, "
                "e.g. https://agentops.example.com",
                id="agentops.E001",
            )
        ]
    parts = urlsplit(base)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return [
            Error(
                f"AGENTOPS_BASE_URL={base!r} is not an http(s) address with a host.",
                hint="e.g. https://agentops.example.com",
                id="agentops.E002",
            )
        ]
    if sends_email and parts.scheme != "https" and not settings.DEBUG:
        return [
            Warning(
                f"AGENTOPS_BASE_URL={base!r} is not https, and production serves https only: "
                "emailed links are redirected, their tokens sent in the clear first.",
                hint="Use the https address of the console.",
                id="agentops.W001",
            )
        ]
    return []

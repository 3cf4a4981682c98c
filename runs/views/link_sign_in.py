"""Signing in from an emailed link (approvals and questions alike).

The link's path holds its token: as the sign-in page's ``next=`` it would be written to
access logs, the login form and the Referer of everything that page loads. The path waits in
the session instead (signing in keeps the session's data), and ``next=`` names a page without
a secret that sends the person on.
"""

from __future__ import annotations

from django.contrib.auth.decorators import login_required
from django.contrib.auth.views import redirect_to_login
from django.http import HttpRequest, HttpResponse
from django.shortcuts import redirect
from django.urls import reverse
from django.utils.http import url_has_allowed_host_and_scheme

_LINK_AFTER_SIGN_IN = "agentops_link_after_sign_in"


def sign_in_url_keeping_the_link(request: HttpRequest, *, after: str) -> str:
    """The sign-in page's URL; once signed in, ``after`` (a URL name served by
    ``link_after_sign_in``) sends the person back to this link."""
    request.session[_LINK_AFTER_SIGN_IN] = request.path
    return redirect_to_login(reverse(after))["Location"]


def link_after_sign_in(request: HttpRequest, *, fallback: str) -> HttpResponse:
    """Back to the link the person signed in for, or ``fallback`` (a URL name)."""
    path = request.session.pop(_LINK_AFTER_SIGN_IN, None)
    if not path or not url_has_allowed_host_and_scheme(path, allowed_hosts=None):
        return redirect(fallback)
    return redirect(path)


@login_required
def question_link_after_sign_in(request: HttpRequest) -> HttpResponse:
    return link_after_sign_in(request, fallback="runs:questions")

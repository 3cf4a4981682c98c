"""The pages of emailed links (docs/links.md), one machinery for approvals and questions.

GET (and HEAD) only shows a page: mail scanners and link previews open links and must decide
nothing. POST decides, with the CSRF token, as the link's recipient signed in (``runs.links``).
Each kind declares a ``LinkPage`` — its template (``templates/links/page.html`` extended by a
block or two of its own), the state its object is in, and what its form's POST does — and
``link_view`` serves it. The pages of every state a link can be in are shared: not valid
(404), sent to someone else (403), sign in first, open (the form), done, expired or withdrawn
(410), refused (403).

Signing in from a link: the link's path holds its token, and as the sign-in page's ``next=``
it would be written to access logs, the login form and the Referer of everything that page
loads. The path waits in the session instead (signing in keeps the session's data), and
``next=`` names a page without a secret (``link_after_sign_in``) that sends the person back.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from django.contrib.auth.decorators import login_required
from django.contrib.auth.views import redirect_to_login
from django.http import HttpRequest, HttpResponse
from django.shortcuts import redirect, render
from django.urls import reverse
from django.utils.http import url_has_allowed_host_and_scheme
from django.views.decorators.cache import never_cache
from django.views.decorators.http import require_http_methods

from runs import links
from runs.actors import PermissionDenied

_LINK_AFTER_SIGN_IN = "agentops_link_after_sign_in"

# the HTTP status of each state's page (the rest are 200): a link that can no longer decide
# is gone
STATUS = {"invalid": 404, "not_yours": 403, "refused": 403, "expired": 410, "cancelled": 410}
GONE = ("expired", "cancelled")


class LinkFormError(Exception):
    """What was posted cannot be decided (a missing reason, an answer not among the choices):
    the form again with the error and what was written, nothing used up (400)."""


@dataclass(frozen=True)
class LinkPage:
    """What one kind's link page has of its own."""

    kind: links.LinkKind
    template: str  # extends links/page.html
    done: str  # the state after a decision: "decided", "answered"
    after_sign_in: str  # URL name of the page that sends a person back after signing in
    inbox: str  # URL name of where this kind's objects are decided in the console
    inbox_label: str  # "approvals inbox"
    nothing_done: str  # "Nothing was decided."
    recipient_noun: str  # "approver": "each approver gets their own link"
    # the link's state: "confirm" while it can decide, else done, "expired", "cancelled", …
    state: Callable[[Any], str]
    # the kind's facts for its page (its template's ``object`` block)
    context: Callable[[HttpRequest, Any], dict[str, Any]]
    # the POST: decide with request.POST, as the link's recipient (raises LinkFormError, a
    # conflict, or PermissionDenied)
    decide: Callable[[HttpRequest, str], Any]
    # besides LinkUsed, what ``decide`` raises when the object was decided or closed meanwhile
    conflicts: tuple[type[Exception], ...] = ()


def client_of(request: HttpRequest) -> dict[str, str]:
    """Where a link's POST came from, recorded with its use."""
    return {
        "client_ip": request.META.get("REMOTE_ADDR", ""),
        "user_agent": request.META.get("HTTP_USER_AGENT", ""),
    }


def _page(
    request: HttpRequest,
    page: LinkPage,
    state: str,
    *,
    link: Any = None,
    status: int | None = None,
    error: str = "",
    posted: Any = None,
) -> HttpResponse:
    context: dict[str, Any] = {
        "state": state,
        "error": error,
        "link": link,
        "page": page,
        "posted": posted if posted is not None else {},
    }
    if link is not None:
        context["recipient"] = page.kind.recipient_of(link)
        context.update(page.context(request, link))
    if state == "login":
        context["sign_in_url"] = sign_in_url_keeping_the_link(request, after=page.after_sign_in)
    response = render(request, page.template, context, status=status or STATUS.get(state, 200))
    # the token is in the URL: keep it out of other sites' Referer headers, caches and search
    # engines. Not "no-referrer": browsers then send "Origin: null" with the form's POST,
    # which Django's CSRF origin check refuses (tests/browser/test_console.py)
    response["Referrer-Policy"] = "same-origin"
    response["X-Robots-Tag"] = "noindex, nofollow"
    return response


def link_view(page: LinkPage) -> Callable[[HttpRequest, str], HttpResponse]:
    """The view of one kind's link URL (``<kind>/link/<token>/``)."""

    @never_cache
    @require_http_methods(["GET", "HEAD", "POST"])
    def view(request: HttpRequest, token: str) -> HttpResponse:
        try:
            link = links.link_get(page.kind, token)
        except links.LinkInvalid:
            return _page(request, page, "invalid")
        try:
            links.link_check_user(page.kind, link, request.user)
        except links.LinkNotYours as exc:
            return _page(request, page, "not_yours", link=link, error=str(exc))
        except links.LinkLoginRequired:
            if request.method == "POST":
                return redirect(sign_in_url_keeping_the_link(request, after=page.after_sign_in))
            state = page.state(link)
            return _page(request, page, "login" if state == "confirm" else state, link=link)
        if request.method != "POST":
            return _page(request, page, page.state(link), link=link)

        try:
            page.decide(request, token)
        except LinkFormError as exc:
            return _page(
                request,
                page,
                "confirm",
                link=link,
                status=400,
                error=str(exc),
                posted=request.POST,
            )
        except (links.LinkUsed, *page.conflicts) as exc:
            link = links.link_get(page.kind, token)
            state = page.state(link)
            status = 410 if state in GONE else 409
            return _page(request, page, state, link=link, status=status, error=str(exc))
        except PermissionDenied as exc:
            return _page(request, page, "refused", link=link, error=str(exc))
        return _page(request, page, page.done, link=links.link_get(page.kind, token))

    return view


# --- signing in from a link ----------------------------------------------------------------


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


def after_sign_in_view(page: LinkPage) -> Callable[[HttpRequest], HttpResponse]:
    """The view of one kind's ``signed-in/`` URL: ``next=`` of its sign-in links."""

    @login_required
    def view(request: HttpRequest) -> HttpResponse:
        return link_after_sign_in(request, fallback=page.inbox)

    return view

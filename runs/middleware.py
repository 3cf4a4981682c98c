"""Console middleware: times in the operator's own timezone, a signed-out htmx request
sent to the sign-in page as a whole page, and idle sessions signed out.

``static/js/timezone.js`` stores the browser's IANA zone name in the ``tz`` cookie; this
middleware activates it for the request. A missing or unknown zone falls back to
``settings.TIME_ZONE`` (the first page of a new session, or a browser without JavaScript).
"""

from __future__ import annotations

import time
import zoneinfo
from collections.abc import Callable
from functools import lru_cache
from typing import Any

from django.conf import settings
from django.contrib.auth import logout
from django.http import HttpRequest, HttpResponse, HttpResponseBadRequest, JsonResponse
from django.shortcuts import resolve_url
from django.utils import timezone

TZ_COOKIE = "tz"


@lru_cache(maxsize=64)
def _zone(name: str) -> zoneinfo.ZoneInfo | None:
    # the cookie is client input: only names the tz database knows are accepted
    if not name or len(name) > 64 or ".." in name or name.startswith("/"):
        return None
    try:
        return zoneinfo.ZoneInfo(name)
    except (zoneinfo.ZoneInfoNotFoundError, ValueError):
        return None


class OperatorTimezoneMiddleware:
    def __init__(self, get_response: Callable[[HttpRequest], HttpResponse]) -> None:
        self.get_response = get_response

    def __call__(self, request: HttpRequest) -> HttpResponse:
        # the API answers in UTC whoever calls it (DRF renders datetimes in the active zone)
        name = "" if request.path.startswith("/api/") else request.COOKIES.get(TZ_COOKIE, "")
        zone = _zone(name)
        if zone is not None:
            timezone.activate(zone)
        else:
            timezone.deactivate()
        try:
            return self.get_response(request)
        finally:
            timezone.deactivate()


class HtmxLoginRedirectMiddleware:
    """A session that expired while a page polls: the sign-in redirect of a partial would be
    followed by the browser and the sign-in page swapped into a table. Tell htmx to load it
    as the whole page instead (``HX-Redirect``), coming back to the page after signing in."""

    def __init__(self, get_response: Callable[[HttpRequest], HttpResponse]) -> None:
        self.get_response = get_response

    def __call__(self, request: HttpRequest) -> HttpResponse:
        response = self.get_response(request)
        if (
            request.headers.get("HX-Request") == "true"
            and response.status_code == 302
            and response.get("Location", "").startswith(resolve_url(settings.LOGIN_URL))
        ):
            redirect = HttpResponse(status=204)
            redirect["HX-Redirect"] = response["Location"]
            return redirect
        return response


class RefuseNulMiddleware:
    """A NUL character in the path or the query string is bad input, answered with a 400
    before any view runs: PostgreSQL cannot compare text containing one (a lookup by such a
    name failed with a server error), SQLite can — the two databases would disagree."""

    def __init__(self, get_response: Callable[[HttpRequest], HttpResponse]) -> None:
        self.get_response = get_response

    def __call__(self, request: HttpRequest) -> HttpResponse:
        query = request.META.get("QUERY_STRING", "")
        if "\x00" in request.path or "%00" in query or "\x00" in query:
            body = {"code": "nul_byte", "detail": "NUL characters are not allowed in a URL"}
            if request.path.startswith("/api/"):
                return JsonResponse(body, status=400)
            return HttpResponseBadRequest(body["detail"], content_type="text/plain")
        return self.get_response(request)


# the session key holding the time of the signed-in person's last action (epoch seconds)
LAST_ACTIVE_KEY = "agentops_last_active"
# how stale the stored time may get before a request writes it again: a session write per
# minute of activity, not one per request
_ACTIVITY_RESOLUTION = 60


class IdleSessionMiddleware:
    """Signs out a session idle for ``SESSION_IDLE_TIMEOUT`` seconds (issue 17).

    Activity is any request but an htmx GET: the list, dashboard and inbox pages refresh
    themselves every few seconds, and a tab left open on them is not a person at the desk.
    Each write of the time also renews the session's stored expiry and its cookie
    (``SESSION_COOKIE_AGE`` = the same timeout), so the server forgets an idle session even
    if no request comes to end it here."""

    def __init__(self, get_response: Callable[[HttpRequest], HttpResponse]) -> None:
        self.get_response = get_response

    def __call__(self, request: HttpRequest) -> HttpResponse:
        user = getattr(request, "user", None)
        if user is not None and user.is_authenticated:
            now = time.time()
            last = request.session.get(LAST_ACTIVE_KEY)
            if isinstance(last, int | float) and now - last > settings.SESSION_IDLE_TIMEOUT:
                logout(request)
            elif not _is_background_refresh(request) and (
                not isinstance(last, int | float) or now - last >= _ACTIVITY_RESOLUTION
            ):
                request.session[LAST_ACTIVE_KEY] = now
        return self.get_response(request)


def session_mark_active(sender: Any, request: Any, user: Any, **kwargs: Any) -> None:
    """``user_logged_in``: the clock starts at sign-in, in the session write that signing in
    makes anyway (not in a second one at the next page)."""
    session = getattr(request, "session", None)
    if session is not None:
        session[LAST_ACTIVE_KEY] = time.time()


def _is_background_refresh(request: HttpRequest) -> bool:
    return request.method == "GET" and request.headers.get("HX-Request") == "true"

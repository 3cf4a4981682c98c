"""Console middleware: times in the operator's own timezone, and a signed-out htmx request
sent to the sign-in page as a whole page.

``static/js/timezone.js`` stores the browser's IANA zone name in the ``tz`` cookie; this
middleware activates it for the request. A missing or unknown zone falls back to
``settings.TIME_ZONE`` (the first page of a new session, or a browser without JavaScript).
"""

from __future__ import annotations

import zoneinfo
from collections.abc import Callable
from functools import lru_cache

from django.conf import settings
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

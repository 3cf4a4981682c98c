"""API throttling of requests that carry no credentials or bad ones (issue 17).

DRF runs a view's throttles after authentication and the permission check, so a request with
no credentials (401/403) or a bad token (401) was never counted: anyone could probe tokens or
load the database as fast as they liked. These are counted here, per client address, during
authentication — ``BearerTokenAuthentication`` calls in before anything else looks at the
request. A valid token is never refused for what others sent from its address (a shared NAT):
only failures count, and only failures are answered 429. Authenticated requests keep DRF's
per-user throttle. Both count in the configured cache (the database by default): every
process and machine shares one count.
"""

from __future__ import annotations

from typing import Any

from rest_framework import exceptions
from rest_framework.throttling import SimpleRateThrottle


class UnauthenticatedRateThrottle(SimpleRateThrottle):
    """The ``anon`` rate, per address, for requests that are not (or not validly)
    authenticated. Never reads ``request.user``: it runs while that is being decided."""

    scope = "anon"
    cache_format = "throttle_unauthenticated_%(ident)s"

    def get_cache_key(self, request: Any, view: Any) -> str:
        return self.cache_format % {"ident": self.get_ident(request)}


def _throttled_view(request: Any) -> bool:
    # a view that opted out of throttling (the health endpoint) stays out of this one too
    view = (getattr(request, "parser_context", None) or {}).get("view")
    return view is None or bool(getattr(view, "throttle_classes", None))


def count_unauthenticated(request: Any) -> None:
    """Count a request with no credentials or bad ones, per address; 429 past the ``anon``
    rate (instead of the 401 or 403 it would get)."""
    if not _throttled_view(request):
        return
    throttle = UnauthenticatedRateThrottle()
    if not throttle.allow_request(request, None):
        raise exceptions.Throttled(wait=throttle.wait())

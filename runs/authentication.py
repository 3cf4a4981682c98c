"""``Authorization: Bearer <token>`` for the API: the token acts as its principal user."""

from __future__ import annotations

from drf_spectacular.extensions import OpenApiAuthenticationExtension
from rest_framework import authentication, exceptions

from runs.throttling import count_unauthenticated
from runs.tokens import api_token_authenticate


class BearerTokenAuthentication(authentication.BaseAuthentication):
    """The first authenticator of every API view, so also where requests without valid
    credentials are throttled (runs.throttling): DRF's own throttles run too late for them."""

    keyword = "Bearer"

    def authenticate(self, request):
        header = authentication.get_authorization_header(request).split()
        if not header or header[0].lower() != self.keyword.lower().encode():
            if not _signed_in(request):
                count_unauthenticated(request)
            return None  # not ours: session authentication may still apply
        if len(header) != 2:
            self._refuse(request, "Authorization header must be 'Bearer <token>'.")
        try:
            raw = header[1].decode()
        except UnicodeDecodeError:
            self._refuse(request, "Invalid token.")
        token = api_token_authenticate(raw)
        if token is None:
            # one message for unknown, revoked and expired: nothing to learn by probing
            self._refuse(request, "Invalid, expired or revoked token.")
        return token.principal, token

    @staticmethod
    def _refuse(request, message: str):
        count_unauthenticated(request)
        raise exceptions.AuthenticationFailed(message)

    def authenticate_header(self, request) -> str:
        return f'{self.keyword} realm="api"'


def _signed_in(request) -> bool:
    # the console's session (SessionAuthentication decides next, and checks CSRF); the
    # user was loaded by Django's middleware already, so this costs no query of its own
    user = getattr(request._request, "user", None)
    return bool(user is not None and user.is_active and user.is_authenticated)


class BearerTokenScheme(OpenApiAuthenticationExtension):
    target_class = "runs.authentication.BearerTokenAuthentication"
    name = "bearerAuth"

    def get_security_definition(self, auto_schema):
        return {
            "type": "http",
            "scheme": "bearer",
            "description": "An API token from `manage.py create_api_token` or the admin.",
        }

"""``Authorization: Bearer <token>`` for the API: the token acts as its principal user."""

from __future__ import annotations

from drf_spectacular.extensions import OpenApiAuthenticationExtension
from rest_framework import authentication, exceptions

from runs.tokens import api_token_authenticate


class BearerTokenAuthentication(authentication.BaseAuthentication):
    keyword = "Bearer"

    def authenticate(self, request):
        header = authentication.get_authorization_header(request).split()
        if not header or header[0].lower() != self.keyword.lower().encode():
            return None  # not ours: session authentication may still apply
        if len(header) != 2:
            raise exceptions.AuthenticationFailed("Authorization header must be 'Bearer <token>'.")
        try:
            raw = header[1].decode()
        except UnicodeDecodeError:
            raise exceptions.AuthenticationFailed("Invalid token.") from None
        token = api_token_authenticate(raw)
        if token is None:
            # one message for unknown, revoked and expired: nothing to learn by probing
            raise exceptions.AuthenticationFailed("Invalid, expired or revoked token.")
        return token.principal, token

    def authenticate_header(self, request) -> str:
        return f'{self.keyword} realm="api"'


class BearerTokenScheme(OpenApiAuthenticationExtension):
    target_class = "runs.authentication.BearerTokenAuthentication"
    name = "bearerAuth"

    def get_security_definition(self, auto_schema):
        return {
            "type": "http",
            "scheme": "bearer",
            "description": "An API token from `manage.py create_api_token` or the admin.",
        }

"""``python manage.py create_api_token NAME --principal USERNAME [--expires-days N]``

Prints the raw token alone on its last line (``TOKEN=$(... | tail -1)``); it is stored only
as a hash and cannot be shown again.
"""

from __future__ import annotations

from datetime import timedelta

from django.contrib.auth import get_user_model
from django.core.management.base import BaseCommand, CommandError
from django.utils import timezone

from runs.actors import Actor
from runs.services import InvalidInput
from runs.tokens import api_token_create


class Command(BaseCommand):
    help = "Create an API token acting as a user; prints the raw token on the last line."

    def add_arguments(self, parser):
        parser.add_argument("name", help="a unique name for the token (e.g. the agent's name)")
        parser.add_argument("--principal", required=True, help="username the token acts as")
        parser.add_argument("--expires-days", type=int, default=None)
        parser.add_argument("--webhook-url", default="")

    def handle(self, *args, **options):
        User = get_user_model()
        username = options["principal"]
        try:
            principal = User.objects.get(**{User.USERNAME_FIELD: username})
        except User.DoesNotExist:
            raise CommandError(f"no user named {username!r}") from None
        expires_at = None
        if options["expires_days"] is not None:
            if options["expires_days"] < 1:
                raise CommandError("--expires-days must be at least 1")
            expires_at = timezone.now() + timedelta(days=options["expires_days"])
        try:
            token, raw = api_token_create(
                name=options["name"],
                principal=principal,
                actor=Actor.system("cli"),
                expires_at=expires_at,
                webhook_url=options["webhook_url"],
            )
        except InvalidInput as exc:
            raise CommandError(str(exc)) from None
        expiry = token.expires_at.isoformat() if token.expires_at else "never"
        self.stderr.write(
            f"Token {token.name!r} ({token.prefix}…) acts as {username}; expires: {expiry}. "
            "It is shown only now:"
        )
        if token.webhook_secret:
            self.stderr.write(f"Webhook signing secret: {token.webhook_secret}")
        self.stdout.write(raw)

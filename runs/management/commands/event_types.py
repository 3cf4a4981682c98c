"""``python manage.py event_types`` — every event type a run's record holds, as the
Markdown table docs/audit.md embeds (from ``runs.record.eventtypes.EventType``)."""

from __future__ import annotations

from django.core.management.base import BaseCommand

from runs.record.eventtypes import markdown_table


class Command(BaseCommand):
    help = "Print the catalogue of run event types as a Markdown table (docs/audit.md)."

    def handle(self, *args, **options) -> None:
        self.stdout.write(markdown_table())

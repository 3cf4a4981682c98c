from __future__ import annotations

from django.apps import AppConfig


class DemoConfig(AppConfig):
    name = "agentops.demo"
    label = "demo"
    verbose_name = "Demo agents"

    def ready(self) -> None:
        from agentops.demo import agents

        agents.register()

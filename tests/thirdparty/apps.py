from __future__ import annotations

from django.apps import AppConfig


class ThirdPartyAgentsConfig(AppConfig):
    name = "tests.thirdparty"
    label = "thirdparty_agents"

    def ready(self) -> None:
        from runs.registry import registry
        from tests.thirdparty.agents import GREET, Greeter

        registry.register_tool(GREET)
        registry.register_agent(Greeter())

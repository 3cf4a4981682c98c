from __future__ import annotations

from django.apps import AppConfig


class RollingConfig(AppConfig):
    name = "tests.rolling"
    label = "rolling_agents"

    def ready(self) -> None:
        from runs.registry import registry
        from tests.rolling.agents import build

        tool, agent = build()
        registry.register_tool(tool)
        registry.register_agent(agent)

from __future__ import annotations

from django.apps import AppConfig


class McpConfig(AppConfig):
    name = "agentops.mcp"
    label = "mcp"
    verbose_name = "MCP gateway"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        from django.conf import settings

        from agentops.mcp import gateway, upstream

        upstream.register(upstream.parse(settings.AGENTOPS_MCP["UPSTREAMS"]))
        gateway.register()

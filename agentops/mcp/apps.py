from django.apps import AppConfig


class McpConfig(AppConfig):
    name = "agentops.mcp"
    label = "mcp"
    verbose_name = "MCP gateway"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        from agentops.mcp import gateway

        gateway.register()

"""``python manage.py runmcp [--host H] [--port P]``: the MCP gateway's own process
(docs/mcp.md), uvicorn serving ``agentops.mcp.asgi``. Held ``tools/call`` requests wait here,
never in the web server's request slots; the process holds nothing the record lacks, so
killing it at any moment loses no call."""

from __future__ import annotations

from django.conf import settings
from django.core.management.base import BaseCommand


class Command(BaseCommand):
    help = "Serve the MCP gateway (streamable HTTP at /mcp/)."

    def add_arguments(self, parser) -> None:
        parser.add_argument("--host", default=None, help="default: AGENTOPS_MCP_HOST")
        parser.add_argument("--port", type=int, default=None, help="default: AGENTOPS_MCP_PORT")

    def handle(self, *args, **options) -> None:
        import uvicorn

        from agentops.mcp.server import build_app

        host = options["host"] or settings.AGENTOPS_MCP["HOST"]
        port = options["port"] if options["port"] is not None else settings.AGENTOPS_MCP["PORT"]
        self.stdout.write(f"MCP gateway on http://{host}:{port}/mcp/", ending="\n")
        self.stdout.flush()
        uvicorn.run(
            build_app(),
            host=host,
            port=port,
            log_level="warning",
            # a held call is at most HOLD_SECONDS; SIGTERM lets them answer "pending" first
            timeout_graceful_shutdown=5,
        )

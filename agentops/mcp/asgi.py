"""ASGI entry point of the MCP gateway's own process (``manage.py runmcp``, Procfile ``mcp``):
held ``tools/call`` requests never occupy the web server's request slots."""

from __future__ import annotations

import os

import django

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "agentops.settings")
django.setup()

from agentops.mcp.server import build_app  # noqa: E402

application = build_app()

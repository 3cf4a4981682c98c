"""What the MCP gateway adds to the record: which MCP ``tools/call`` became which call of
which run (docs/mcp.md). The call itself — its key, approval, dispatch, receipt — is the
engine's ``ToolCall``; this row only maps the client's key to it."""

from __future__ import annotations

from django.conf import settings
from django.db import models
from django.db.models import Q

from runs.models import Run, ToolCall


class GatewaySession(models.Model):
    """Which run a principal's calls go into when the client names none: one per session of
    the MCP transport, or per token when the protocol has no session. Unique, so two gateway
    processes taking the first call of a session at once agree on one run."""

    principal = models.ForeignKey(
        settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="gateway_sessions"
    )
    session_key = models.CharField(max_length=200)
    run = models.ForeignKey(Run, on_delete=models.CASCADE, related_name="gateway_sessions")
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        constraints = [
            models.UniqueConstraint(
                fields=["principal", "session_key"], name="gatewaysession_principal_key"
            )
        ]

    def __str__(self) -> str:
        return f"{self.session_key} → {self.run_id}"


class GatewayCall(models.Model):
    """One MCP ``tools/call`` the gateway recorded. The gateway agent turns the ``position``-th
    of its run into the run's ``position``-th tool-call step (``agentops.mcp.gateway``), so
    the mapping to the step needs no write by the engine; ``tool_call`` caches it once seen.

    The key that makes a repeated ``tools/call`` find this row: the client's own key
    (``_meta["agentops/idempotency_key"]``, unique per principal, across runs and
    reconnections), or else the digest of tool and arguments within the run. Never the
    JSON-RPC id or the session: both change when a client retries or reconnects."""

    run = models.ForeignKey(Run, on_delete=models.CASCADE, related_name="gateway_calls")
    position = models.PositiveIntegerField()
    principal = models.ForeignKey(
        settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="gateway_calls"
    )
    tool_name = models.CharField(max_length=200)
    # the arguments as the client sent them, until the engine records them on its ToolCall
    # (where sensitive fields stay unmasked too); events carry only the digest
    arguments = models.JSONField(default=dict)
    arguments_digest = models.CharField(max_length=64)
    client_key = models.CharField(max_length=200, blank=True)
    tool_call = models.OneToOneField(
        ToolCall, null=True, blank=True, on_delete=models.SET_NULL, related_name="gateway_call"
    )
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["run", "position"], name="gatewaycall_run_position"),
            models.UniqueConstraint(
                fields=["principal", "client_key"],
                condition=~Q(client_key=""),
                name="gatewaycall_principal_client_key",
            ),
            models.UniqueConstraint(
                fields=["run", "arguments_digest"],
                condition=Q(client_key=""),
                name="gatewaycall_run_digest",
            ),
        ]

    def __str__(self) -> str:
        return f"{self.tool_name} #{self.position} of {self.run_id}"

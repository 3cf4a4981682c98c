"""What a remote agent's process reads to carry out the calls MCP clients made of its
manifest tools (docs/mcp.md, "A remote agent's tools"): ``agentops.mcp.remote`` over HTTP.
Writes go through the remote protocol itself (lease, propose, dispatch, receipt)."""

from __future__ import annotations

from drf_spectacular.utils import extend_schema
from rest_framework import serializers
from rest_framework.response import Response
from rest_framework.views import APIView

from agentops.mcp import remote
from runs.api.common import actor_for, errors


class WaitingRunSerializer(serializers.Serializer):
    id = serializers.UUIDField()
    status = serializers.CharField()
    created_at = serializers.DateTimeField()


class McpRunsApi(APIView):
    @extend_schema(
        summary="An agent's MCP gateway runs waiting for a process, oldest first",
        description="For the agent's owner: runs of the agent that hold calls MCP clients "
        "made of its manifest tools and are queued (a call recorded, a wait ended, an "
        "approval decided, a lease expired). Lease one and serve its calls.",
        responses={200: WaitingRunSerializer(many=True), **errors("not_found")},
    )
    def get(self, request, name):
        runs = remote.mcp_runs_waiting(agent_name=name, actor=actor_for(request))
        return Response(WaitingRunSerializer(runs, many=True).data)


class RecordedCallSerializer(serializers.Serializer):
    position = serializers.IntegerField()
    call_id = serializers.CharField(help_text="Propose the call under this client_call_id.")
    tool = serializers.CharField(help_text="The manifest's name of the tool.")
    arguments = serializers.JSONField()
    tool_call_id = serializers.IntegerField(
        allow_null=True, help_text="The call proposed for it; null: propose it."
    )
    tool_call_status = serializers.CharField(allow_null=True)


class McpCallsApi(APIView):
    @extend_schema(
        summary="The MCP calls recorded in a run, in order (for the lease holder)",
        description="Each tools/call an MCP client made of the agent's manifest tools, "
        "with its arguments unmasked: only the process that holds the run's lease reads "
        "them. Propose each not yet proposed with its call_id as client_call_id.",
        responses={200: RecordedCallSerializer(many=True), **errors("not_found")},
    )
    def get(self, request, run_id):
        calls = remote.mcp_calls_of(run_id=run_id, actor=actor_for(request))
        return Response(RecordedCallSerializer(calls, many=True).data)

"""One agent (hosted or remote) with its tools, and a remote agent's manifest registered or
updated (``runs.remote.agent_manifest_put``)."""

from __future__ import annotations

from drf_spectacular.utils import OpenApiParameter, OpenApiResponse, extend_schema
from rest_framework import serializers, status
from rest_framework.response import Response
from rest_framework.views import APIView

from runs import remote
from runs.api import AgentSerializer, agent_data
from runs.api.common import ApiError, actor_for, errors
from runs.models import AgentManifest
from runs.registry import OnExpiry, UnknownAgent, registry


class ManifestApprovalSerializer(serializers.Serializer):
    when = serializers.JSONField(
        required=False,
        help_text='"never", "always", or a rule {"argument", "op": eq|ne|gt|gte|lt|lte|in, '
        '"value"}.',
    )
    group = serializers.CharField(required=False, help_text="Who may approve (a group).")
    required = serializers.IntegerField(required=False, min_value=1, max_value=10)
    ttl_seconds = serializers.IntegerField(required=False, min_value=60, max_value=2592000)
    on_expiry = serializers.ChoiceField(
        choices=[action.value for action in OnExpiry], required=False
    )


class ManifestLimitsSerializer(serializers.Serializer):
    max_in_flight = serializers.IntegerField(required=False, min_value=1)
    rate = serializers.FloatField(required=False, help_text="Calls per per_seconds.")
    per_seconds = serializers.FloatField(required=False, help_text="1 (default) or 60.")
    burst = serializers.IntegerField(required=False, min_value=1)
    key_argument = serializers.CharField(
        required=False, max_length=100, help_text="One limit per value of this argument."
    )


class ManifestToolSerializer(serializers.Serializer):
    name = serializers.CharField(max_length=60)
    version = serializers.CharField(max_length=64, required=False)
    description = serializers.CharField(required=False, allow_blank=True)
    effect = serializers.ChoiceField(choices=["read", "idempotent", "reconcilable", "unsafe"])
    argument_schema = serializers.DictField(required=False, help_text="A JSON Schema (an object).")
    sensitive_fields = serializers.ListField(child=serializers.CharField(), required=False)
    sensitive_output = serializers.ListField(
        child=serializers.CharField(),
        required=False,
        help_text='Paths into the result whose values are masked when shown (dotted keys, "*" '
        "for every list item), e.g. customer.email.",
    )
    approval = ManifestApprovalSerializer(required=False)
    timeout = serializers.FloatField(required=False, min_value=0.001, max_value=86400)
    allowed_groups = serializers.ListField(child=serializers.CharField(), required=False)
    precondition = serializers.BooleanField(required=False)
    honours_key = serializers.BooleanField(
        required=False,
        help_text="The downstream deduplicates by the idempotency key (default: true for "
        "idempotent tools, false otherwise): an unknown outcome may be sent again at once.",
    )
    honours_deadline = serializers.BooleanField(
        required=False,
        default=False,
        help_text="The downstream refuses a request it receives after the send deadline it "
        "carries (X-Agentops-Send-Deadline).",
    )
    resend = serializers.ChoiceField(
        choices=["auto", "person"],
        required=False,
        default="auto",
        help_text="auto: a valid absent lookup allows a re-dispatch with the same key. person: "
        "it parks the run for an operator instead (needs_attention, unknown_outcome).",
    )
    limits = ManifestLimitsSerializer(
        required=False,
        help_text="How much of its downstream the tool may use across all agent processes "
        "(a dispatch over it is answered 429 at_capacity; an operator's limit replaces it).",
    )


class ManifestInputSerializer(serializers.Serializer):
    """Documents the manifest; ``runs.remote.manifest_validate`` checks it (the service
    validates whoever calls it)."""

    version = serializers.RegexField(remote.VERSION_PATTERN, max_length=50)
    input_schema = serializers.DictField(required=False, help_text="A JSON Schema (an object).")
    tools = ManifestToolSerializer(many=True, required=False)
    migrations = serializers.JSONField(
        required=False,
        help_text='{"<from version>": {"to": "<version>", "description": "..."}}: which older '
        "versions' runs this version may take over.",
    )
    owner = serializers.CharField(
        required=False,
        allow_null=True,
        max_length=150,
        help_text="The username whose API tokens lease and drive this agent's runs (a service "
        "account in the agent role). null: nobody. Left out of an update: unchanged.",
    )
    question_groups = serializers.ListField(
        child=serializers.CharField(max_length=150),
        required=False,
        max_length=20,
        help_text="The groups its runs may ask questions (POST /runs/{id}/waits/, kind "
        "question). Default: none.",
    )


AGENT_NAME_PARAMETER = OpenApiParameter(
    "name",
    str,
    OpenApiParameter.PATH,
    pattern=remote.AGENT_NAME_PATTERN,
    description="The agent's name.",
)


class AgentDetailApi(APIView):
    @extend_schema(
        summary="One agent (hosted or remote) with its tools",
        parameters=[AGENT_NAME_PARAMETER],
        responses={200: AgentSerializer, **errors("not_found")},
    )
    def get(self, request, name):
        try:
            agent = registry.agent(name)
        except UnknownAgent:
            raise ApiError("not_found", "Not found.") from None
        return Response(AgentSerializer(agent_data(agent)).data)

    @extend_schema(
        summary="Register or update a remote agent's manifest (admins only; audited)",
        parameters=[AGENT_NAME_PARAMETER],
        request=ManifestInputSerializer,
        responses={
            200: OpenApiResponse(AgentSerializer, description="Updated."),
            201: OpenApiResponse(AgentSerializer, description="Registered."),
            **errors("validation_error", "invalid_state"),
        },
    )
    def put(self, request, name):
        manifest, created = remote.agent_manifest_put(
            name=name, manifest=request.data, actor=actor_for(request), request=request
        )
        agent = remote.RemoteAgent(AgentManifest.objects.get(name=manifest.name))
        return Response(
            AgentSerializer(agent_data(agent)).data,
            status=status.HTTP_201_CREATED if created else status.HTTP_200_OK,
        )

"""Signals (issue 5): a named message to a run, kept until a wait for its name consumes it
(docs/waits.md)."""

from __future__ import annotations

from drf_spectacular.utils import OpenApiResponse, extend_schema
from rest_framework import serializers, status
from rest_framework.response import Response
from rest_framework.views import APIView

from runs.api.common import ApiError, actor_for, errors
from runs.api.remote.common import json_value, request_data
from runs.models import Run, Signal
from runs.waits import run_signal

# signal names are identifiers: what a wait's code names, safe in logs and URLs
SIGNAL_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.:-]{0,99}$"


class SignalInputSerializer(serializers.Serializer):
    name = serializers.RegexField(
        SIGNAL_NAME_PATTERN, max_length=100, help_text="The name a wait listens for."
    )
    payload = serializers.JSONField(required=False, allow_null=True, default=None)
    idempotency_key = serializers.CharField(
        max_length=200,
        required=False,
        allow_blank=True,
        default="",
        help_text="The same key again is the same signal: delivered once.",
    )

    def validate_payload(self, value):
        return json_value(value)

    def validate_idempotency_key(self, value):
        return json_value(value)


class SignalSerializer(serializers.ModelSerializer):
    run = serializers.UUIDField(source="run_id")
    payload = serializers.JSONField(allow_null=True)

    class Meta:
        model = Signal
        fields = [
            "id",
            "run",
            "name",
            "payload",
            "idempotency_key",
            "sent_by",
            "channel",
            "received_at",
            "consumed_at",
        ]
        read_only_fields = fields


class SignalApi(APIView):
    @extend_schema(
        summary="Send a signal to a run (kept until a wait for its name consumes it)",
        request=SignalInputSerializer,
        responses={
            202: OpenApiResponse(
                SignalSerializer, description="Accepted (or the same key's first signal)."
            ),
            **errors("validation_error", "not_found", "invalid_state", "idempotency_key_reused"),
        },
    )
    def post(self, request, run_id):
        data = request_data(SignalInputSerializer, request)
        if not Run.objects.filter(id=run_id).exists():
            raise ApiError("not_found", "Not found.")
        signal = run_signal(
            run_id=run_id,
            name=data["name"],
            payload=data["payload"],
            idempotency_key=data["idempotency_key"] or None,
            actor=actor_for(request),
        )
        return Response(SignalSerializer(signal).data, status=status.HTTP_202_ACCEPTED)

"""A lease holder's steps: a decision checkpointed with the run's new state, and the run's
finish."""

from __future__ import annotations

from decimal import Decimal

from drf_spectacular.utils import OpenApiResponse, extend_schema
from rest_framework import serializers
from rest_framework.response import Response
from rest_framework.views import APIView

from runs import remote, selectors
from runs.api import RunSerializer
from runs.api.common import actor_for, errors
from runs.api.remote.common import (
    MAX_SEQ,
    SEQ_HELP,
    FenceSerializer,
    json_value,
    lease_proof,
    recorded_response,
    request_data,
)
from runs.models import Step


class StepInputSerializer(FenceSerializer):
    input = serializers.JSONField(
        required=False, default=dict, help_text="What was decided on (stored as given)."
    )
    output = serializers.JSONField(required=False, allow_null=True, default=None)
    state = serializers.DictField(
        required=False, help_text="The run's new state (replaces the old one)."
    )
    cost = serializers.FloatField(
        min_value=0, max_value=1_000_000, required=False, default=0, help_text="Model cost."
    )
    tokens = serializers.IntegerField(min_value=0, max_value=10**12, required=False, default=0)
    seq = serializers.IntegerField(
        min_value=1, max_value=MAX_SEQ, required=False, help_text=SEQ_HELP
    )

    def validate_input(self, value):
        return json_value(value)

    def validate_output(self, value):
        return json_value(value)

    def validate_state(self, value):
        return json_value(value)


class StepSerializer(serializers.ModelSerializer):
    input = serializers.JSONField()
    output = serializers.JSONField(allow_null=True)

    class Meta:
        model = Step
        fields = ["seq", "kind", "status", "input", "output", "error", "cost", "tokens"]
        read_only_fields = fields


class StepApi(APIView):
    @extend_schema(
        summary="Checkpoint a decision and the run's new state",
        request=StepInputSerializer,
        responses={
            201: OpenApiResponse(StepSerializer, description="Recorded."),
            200: OpenApiResponse(
                StepSerializer, description="A retry (same fence and seq): the step recorded."
            ),
            **errors(
                "validation_error",
                "not_found",
                "invalid_state",
                "lease_lost",
                "lease_not_yours",
                "budget_exhausted",
            ),
        },
    )
    def post(self, request, run_id):
        data = request_data(StepInputSerializer, request)
        recorded = remote.remote_step_record(
            run_id=run_id,
            **lease_proof(data),
            actor=actor_for(request),
            input=data["input"],
            output=data["output"],
            state=data.get("state"),
            cost=Decimal(str(data["cost"])).quantize(Decimal("0.000001")),
            tokens=data["tokens"],
            seq=data.get("seq"),
        )
        return recorded_response(StepSerializer(recorded.step).data, replayed=recorded.replayed)


class FinishInputSerializer(FenceSerializer):
    status = serializers.ChoiceField(choices=["succeeded", "failed"], default="succeeded")
    result = serializers.JSONField(required=False, allow_null=True, default=None)
    reason = serializers.CharField(
        max_length=2000,
        required=False,
        allow_blank=True,
        default="",
        help_text="Required when failed.",
    )

    def validate_result(self, value):
        return json_value(value)


class FinishApi(APIView):
    @extend_schema(
        summary="Finish the run (succeeded with a result, or failed with a reason)",
        request=FinishInputSerializer,
        responses={
            200: RunSerializer,
            **errors(
                "validation_error", "not_found", "invalid_state", "lease_lost", "lease_not_yours"
            ),
        },
    )
    def post(self, request, run_id):
        data = request_data(FinishInputSerializer, request)
        run = remote.remote_run_finish(
            run_id=run_id,
            **lease_proof(data),
            actor=actor_for(request),
            status=data["status"],
            result=data["result"],
            reason=data["reason"],
        )
        return Response(RunSerializer(selectors.run_get(run_id=run.id)).data)

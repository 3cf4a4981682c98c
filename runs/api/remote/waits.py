"""A lease holder's durable waits (docs/waits.md): for a signal, a time or a person's answer;
the run is parked and the lease released until the wait ends."""

from __future__ import annotations

from typing import Any

from django.contrib.auth.models import Group
from drf_spectacular.utils import OpenApiResponse, PolymorphicProxySerializer, extend_schema
from rest_framework import serializers
from rest_framework.views import APIView

from runs import remote
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
from runs.api.signals import SIGNAL_NAME_PATTERN
from runs.registry import AskQuestion, Sleep, WaitForSignal
from runs.waits import ANSWER_MAX

# ten years: longer waits are better modelled as a signal with no timeout
MAX_WAIT_SECONDS = 10 * 365 * 24 * 3600


class WaitOutcomeSerializer(serializers.Serializer):
    kind = serializers.ChoiceField(choices=remote.WAIT_KINDS)
    ended_by = serializers.ChoiceField(
        choices=["signal", "answer", "timer", "timeout"],
        help_text="What ended the wait. timeout: the step's output is the wait's default.",
    )
    timed_out = serializers.BooleanField()
    signal_id = serializers.IntegerField(allow_null=True, help_text="The signal it consumed.")
    question_id = serializers.IntegerField(allow_null=True)
    answered_by = serializers.CharField(allow_null=True, help_text="Who answered the question.")


class WaitInputSerializer(FenceSerializer):
    kind = serializers.ChoiceField(
        choices=remote.WAIT_KINDS,
        help_text="signal: until a signal of that name (sent before or during the wait). "
        "timer: until a time. question: until someone in a group answers.",
    )
    seq = serializers.IntegerField(
        min_value=1, max_value=MAX_SEQ, required=False, help_text=SEQ_HELP
    )


class SignalWaitInputSerializer(WaitInputSerializer):
    kind = serializers.ChoiceField(choices=["signal"])
    name = serializers.RegexField(
        SIGNAL_NAME_PATTERN,
        max_length=100,
        help_text="The signal's name (POST /runs/{id}/signals/ sends it).",
    )
    timeout_seconds = serializers.FloatField(
        min_value=0,
        max_value=MAX_WAIT_SECONDS,
        required=False,
        allow_null=True,
        default=None,
        help_text="null: wait for ever. 0: take a signal already there, else the default.",
    )
    default = serializers.JSONField(
        required=False, allow_null=True, default=None, help_text="The outcome on timeout."
    )

    def validate_default(self, value):
        return json_value(value)


class TimerWaitInputSerializer(WaitInputSerializer):
    kind = serializers.ChoiceField(choices=["timer"])
    until = serializers.DateTimeField(
        required=False, help_text="When to wake up. Exactly one of until and seconds."
    )
    seconds = serializers.FloatField(
        min_value=0, max_value=MAX_WAIT_SECONDS, required=False, help_text="How long to sleep."
    )

    def validate(self, data):
        if ("until" in data) == ("seconds" in data):
            raise serializers.ValidationError("give exactly one of until and seconds")
        return data


class QuestionWaitInputSerializer(WaitInputSerializer):
    kind = serializers.ChoiceField(choices=["question"])
    text = serializers.CharField(max_length=ANSWER_MAX, help_text="The question.")
    choices = serializers.ListField(
        child=serializers.CharField(max_length=200),
        min_length=1,
        max_length=50,
        required=False,
        allow_null=True,
        default=None,
        help_text="The answers to choose from (distinct); null: free text.",
    )
    group = serializers.CharField(
        max_length=150,
        required=False,
        default="operator",
        help_text="Who may answer: the group's members see it in the console and get an email "
        "with their own single-use link.",
    )
    ttl_seconds = serializers.IntegerField(
        min_value=1,
        max_value=MAX_WAIT_SECONDS,
        required=False,
        default=24 * 3600,
        help_text="How long it may be answered; then the wait ends with the default.",
    )
    default = serializers.JSONField(
        required=False,
        allow_null=True,
        default=None,
        help_text="The outcome when nobody answered in time (one of the choices, if any).",
    )

    def validate_choices(self, value):
        if value is not None and len(set(value)) != len(value):
            raise serializers.ValidationError("choices must be distinct")
        return value

    def validate_group(self, value):
        if not Group.objects.filter(name=value).exists():
            raise serializers.ValidationError(f"no group named {value!r}: nobody could answer")
        return value

    def validate_default(self, value):
        return json_value(value)

    def validate(self, data):
        choices, default = data.get("choices"), data.get("default")
        if choices is not None and default is not None and default not in choices:
            raise serializers.ValidationError({"default": ["must be one of the choices"]})
        return data


WAIT_INPUTS: dict[str, type[WaitInputSerializer]] = {
    "signal": SignalWaitInputSerializer,
    "timer": TimerWaitInputSerializer,
    "question": QuestionWaitInputSerializer,
}


def _wait_action(data: dict[str, Any]) -> WaitForSignal | Sleep | AskQuestion:
    if data["kind"] == "signal":
        return WaitForSignal(data["name"], data["timeout_seconds"], data["default"])
    if data["kind"] == "timer":
        return Sleep(until=data.get("until"), seconds=data.get("seconds"))
    return AskQuestion(
        data["text"],
        choices=data["choices"],
        group=data["group"],
        ttl_seconds=data["ttl_seconds"],
        default=data["default"],
    )


class WaitSerializer(serializers.Serializer):
    step_seq = serializers.IntegerField(help_text="The wait's step.")
    kind = serializers.ChoiceField(choices=remote.WAIT_KINDS)
    waiting = serializers.BooleanField(
        help_text="true: the run is parked in waiting_event and the lease is released: stop, "
        "and lease the run again when the run.wait_ended webhook arrives. false: the wait "
        "ended at once (the signal was already there, the time had come): the lease is "
        "still yours, go on with output."
    )
    deadline = serializers.DateTimeField(
        allow_null=True,
        help_text="When it times out (a timer: when it fires); null: never.",
    )
    question = serializers.IntegerField(
        allow_null=True, help_text="The question's id (question waits)."
    )
    output = serializers.JSONField(
        allow_null=True, help_text="The outcome, once the wait ended (see the step's output)."
    )
    outcome = WaitOutcomeSerializer(allow_null=True, help_text="How it ended (null: waiting).")

    def to_representation(self, begun):
        spec = begun.step.input
        return {
            "step_seq": begun.step.seq,
            "kind": spec["wait"],
            "waiting": begun.waiting,
            "deadline": spec.get("deadline"),
            "question": begun.question_id,
            "output": None if begun.waiting else begun.step.output,
            "outcome": begun.outcome,
        }


class WaitApi(APIView):
    @extend_schema(
        summary="Wait durably for a signal, a time or a person's answer (releases the lease)",
        request=PolymorphicProxySerializer(
            component_name="WaitInput",
            serializers=WAIT_INPUTS,
            resource_type_field_name="kind",
        ),
        responses={
            201: OpenApiResponse(WaitSerializer, description="The wait began (or ended at once)."),
            200: OpenApiResponse(
                WaitSerializer,
                description="A retry (same fence and seq): the wait its first attempt began, "
                "as it stands now.",
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
        kind = request.data.get("kind") if isinstance(request.data, dict) else None
        serializer = WAIT_INPUTS.get(kind if isinstance(kind, str) else "", WaitInputSerializer)
        data = request_data(serializer, request)
        begun = remote.remote_wait_begin(
            run_id=run_id,
            **lease_proof(data),
            actor=actor_for(request),
            action=_wait_action(data),
            seq=data.get("seq"),
        )
        return recorded_response(WaitSerializer(begun).data, replayed=begun.replayed)

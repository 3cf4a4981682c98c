"""Answering a question through the API (docs/waits.md): the same service as the console and
the emailed links (``question_answer``), for a member of the asked group — with a bearer
token too, which the console's page does not take."""

from __future__ import annotations

from drf_spectacular.utils import extend_schema
from rest_framework import serializers
from rest_framework.response import Response
from rest_framework.views import APIView

from runs.api.common import actor_for, errors
from runs.models import Question
from runs.waits import ANSWER_MAX, question_answer


class QuestionAnswerInputSerializer(serializers.Serializer):
    answer = serializers.CharField(
        max_length=ANSWER_MAX,
        help_text="One of the question's choices, or free text when it has none.",
    )


class QuestionSerializer(serializers.ModelSerializer):
    run = serializers.UUIDField(source="run_id")
    answered_by = serializers.CharField(
        source="answered_by.username", allow_null=True, default=None
    )

    class Meta:
        model = Question
        fields = [
            "id",
            "run",
            "text",
            "choices",
            "group",
            "status",
            "answer",
            "answered_by",
            "channel",
            "asked_at",
            "answered_at",
            "expires_at",
        ]
        read_only_fields = fields


class QuestionAnswerApi(APIView):
    @extend_schema(
        summary="Answer a question (a member of its group; the first answer wins)",
        request=QuestionAnswerInputSerializer,
        responses={
            200: QuestionSerializer,
            **errors("validation_error", "not_found", "already_decided", "invalid_state"),
        },
    )
    def post(self, request, question_id):
        payload = QuestionAnswerInputSerializer(data=request.data)
        payload.is_valid(raise_exception=True)
        question = question_answer(
            question_id=question_id,
            answer=payload.validated_data["answer"],
            actor=actor_for(request),
        )
        return Response(QuestionSerializer(question).data)

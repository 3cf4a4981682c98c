"""A remote agent's run state patched (RFC 6902) and its conversation history (issue 27):
``runs.remote.history``'s services over HTTP."""

from __future__ import annotations

from typing import Any

from django.conf import settings
from drf_spectacular.utils import OpenApiResponse, extend_schema
from rest_framework import serializers
from rest_framework.response import Response
from rest_framework.reverse import reverse
from rest_framework.views import APIView

from runs import remote
from runs.api.common import QueryParamsSerializer, actor_for, errors
from runs.api.remote.common import (
    MAX_SEQ,
    FenceSerializer,
    json_value,
    lease_proof,
    recorded_response,
    request_data,
)

# --- POST /runs/{id}/state/ ---------------------------------------------------------------------


# RFC 6901: "" or "/"-separated tokens in which "~" only escapes "~" (~0) and "/" (~1)
JSON_POINTER = r"^(/([^~/\x00]|~[01])*)*$"


class PatchOperationSerializer(serializers.Serializer):
    op = serializers.ChoiceField(choices=["add", "remove", "replace", "move", "copy", "test"])
    path = serializers.RegexField(
        JSON_POINTER,
        max_length=2000,
        allow_blank=True,
        trim_whitespace=False,
        help_text='A JSON Pointer (RFC 6901) into the state: "" is the whole state, '
        '"/messages/-" the end of a list.',
    )
    value = serializers.JSONField(
        required=False,
        allow_null=True,
        help_text="add, replace, test: the value (any JSON, null included).",
    )
    from_ = serializers.RegexField(
        JSON_POINTER,
        max_length=2000,
        allow_blank=True,
        required=False,
        trim_whitespace=False,
        help_text="move, copy: the JSON Pointer to take the value from.",
    )

    def get_fields(self):
        fields = super().get_fields()
        fields["from"] = fields.pop("from_")  # a keyword in Python, a member in RFC 6902
        return fields


class StatePatchInputSerializer(FenceSerializer):
    patch = serializers.ListField(
        child=PatchOperationSerializer(),
        min_length=1,
        max_length=remote.PATCH_MAX_OPS,
        help_text="An RFC 6902 JSON Patch: the operations applied in order, all or none. A "
        "test operation that fails is 409 patch_test_failed; a path that is not there, 409 "
        "patch_not_applicable; a malformed operation, 400 invalid_patch.",
    )
    state_version = serializers.IntegerField(
        min_value=0,
        max_value=2**63 - 1,
        required=False,
        allow_null=True,
        default=None,
        help_text="Optional precondition: the state_version the patch was made against (the "
        "resume packet's, or the last patch's answer). Another is 409 state_version_mismatch.",
    )

    def validate_patch(self, value):
        return json_value([dict(operation) for operation in value])


class StatePatchedSerializer(serializers.Serializer):
    state = serializers.JSONField(help_text="The run's state with the patch applied.")
    state_version = serializers.IntegerField(help_text="The new version (the old one + 1).")


class StatePatchApi(APIView):
    @extend_schema(
        summary="Update the run's state with a JSON Patch (RFC 6902), under the lease",
        description="The patched state and state_version + 1 commit with a run.state_patched "
        "event; whatever fails, nothing changes. The result obeys the JSON rule of every "
        "input (json_too_large, json_too_deep, nul_byte) and must stay an object.",
        request=StatePatchInputSerializer,
        responses={
            200: StatePatchedSerializer,
            **errors(
                "validation_error",
                "invalid_patch",
                "json_too_large",
                "not_found",
                "invalid_state",
                "lease_lost",
                "lease_not_yours",
                "state_version_mismatch",
                "patch_test_failed",
                "patch_not_applicable",
            ),
        },
    )
    def post(self, request, run_id):
        data = request_data(StatePatchInputSerializer, request)
        patched = remote.remote_state_patch(
            run_id=run_id,
            **lease_proof(data),
            actor=actor_for(request),
            # the serializer checked the shape; jsonpatch checks the meaning of each op
            patch=data["patch"],
            state_version=data["state_version"],
        )
        return Response(StatePatchedSerializer(patched).data)


# --- /runs/{id}/messages/ ------------------------------------------------------------------------


class MessagesAppendInputSerializer(FenceSerializer):
    messages = serializers.ListField(
        child=serializers.DictField(),
        min_length=1,
        max_length=1000,
        help_text="The messages to append, in order: JSON objects (your framework's own "
        "message objects). Each at most AGENTOPS_HISTORY_MAX_MESSAGE_BYTES of JSON "
        "(message_too_large); the run's whole history at most AGENTOPS_HISTORY_MAX_BYTES "
        "(history_full).",
    )
    after_seq = serializers.IntegerField(
        min_value=0,
        max_value=MAX_SEQ,
        required=False,
        allow_null=True,
        default=None,
        help_text="Optional: the seq of the last message you know of (0: none). Another "
        "last message is 409 history_conflict (last_seq says which); a retry of an append "
        "that was recorded (same fence, after_seq and messages) answers 200 and stores "
        "nothing twice.",
    )

    def validate_messages(self, value):
        return json_value(value)


class MessagesAppendedSerializer(serializers.Serializer):
    first_seq = serializers.IntegerField(help_text="The seq of the first message appended.")
    last_seq = serializers.IntegerField(help_text="The seq of the last (pass it as after_seq).")
    total_bytes = serializers.IntegerField(help_text="The run's history's size now.")
    max_bytes = serializers.SerializerMethodField(help_text="Its limit.")

    def get_max_bytes(self, _appended) -> int:
        return settings.AGENTOPS["HISTORY_MAX_BYTES"]


class MessagesQuerySerializer(QueryParamsSerializer):
    after_seq = serializers.IntegerField(
        min_value=0, max_value=MAX_SEQ, required=False, default=0, help_text="Messages after it."
    )
    limit = serializers.IntegerField(min_value=1, max_value=500, required=False, default=100)


class MessageSerializer(serializers.Serializer):
    seq = serializers.IntegerField()
    message = serializers.JSONField()
    written_by = serializers.CharField(help_text="The principal and process that appended it.")
    incarnation = serializers.IntegerField(help_text="The fence it was appended under.")
    created_at = serializers.DateTimeField()


class MessagePageSerializer(serializers.Serializer):
    results = MessageSerializer(many=True)
    last_seq = serializers.IntegerField(
        help_text="The seq of this page's last message (ask again with after_seq=last_seq)."
    )
    next = serializers.URLField(allow_null=True, help_text="The next page, or null.")


class MessagesApi(APIView):
    @extend_schema(
        summary="Read the run's conversation history (non-authoritative), oldest first",
        description="For the agent's own account (the driver of its runs): the messages may "
        "hold what the agent saw unmasked. Not the record: the steps, calls and receipts are.",
        parameters=[MessagesQuerySerializer],
        responses={
            200: MessagePageSerializer,
            **errors("validation_error", "not_found", "invalid_state"),
        },
    )
    def get(self, request, run_id):
        query = MessagesQuerySerializer(data=request.query_params)
        query.is_valid(raise_exception=True)
        after, limit = query.validated_data["after_seq"], query.validated_data["limit"]
        messages = remote.remote_messages_read(
            run_id=run_id, actor=actor_for(request), after_seq=after, limit=limit + 1
        )
        more = len(messages) > limit
        messages = messages[:limit]
        last = messages[-1].seq if messages else after
        following = None
        if more:
            url = reverse("api:run-messages", kwargs={"run_id": run_id}, request=request)
            following = f"{url}?after_seq={last}&limit={limit}"
        body: dict[str, Any] = {
            "results": MessageSerializer(messages, many=True).data,
            "last_seq": last,
            "next": following,
        }
        return Response(body)

    @extend_schema(
        summary="Append messages to the run's conversation history (non-authoritative)",
        description="Under the lease (fence and lease_token). Not part of the record: no "
        "event, no hash chain; nothing in agentops decides from it. Use it to rebuild your "
        "framework's message history on resume.",
        request=MessagesAppendInputSerializer,
        responses={
            201: OpenApiResponse(MessagesAppendedSerializer, description="Appended."),
            200: OpenApiResponse(
                MessagesAppendedSerializer,
                description="A retry (same fence, after_seq and messages): already appended.",
            ),
            **errors(
                "validation_error",
                "message_too_large",
                "not_found",
                "invalid_state",
                "lease_lost",
                "lease_not_yours",
                "history_full",
                "history_conflict",
            ),
        },
    )
    def post(self, request, run_id):
        data = request_data(MessagesAppendInputSerializer, request)
        appended = remote.remote_messages_append(
            run_id=run_id,
            **lease_proof(data),
            actor=actor_for(request),
            messages=data["messages"],
            after_seq=data["after_seq"],
        )
        return recorded_response(
            MessagesAppendedSerializer(appended).data, replayed=appended.replayed
        )

"""A lease holder's tool calls: propose (the approval policy decides), dispatch, the pre-send
check, reconciliation lookups and the receipt."""

from __future__ import annotations

from drf_spectacular.utils import OpenApiResponse, extend_schema, extend_schema_field
from rest_framework import serializers, status
from rest_framework.response import Response
from rest_framework.views import APIView

from runs import remote, selectors
from runs.api import ToolCallSerializer
from runs.api.common import actor_for, errors
from runs.api.remote.common import (
    DRY_RUN_HELP,
    MAX_SEQ,
    FenceSerializer,
    json_value,
    lease_proof,
    recorded_response,
    request_data,
)
from runs.models import Run


class ClientCallIdField(serializers.RegexField):
    """A string and only a string: an id sent as a number is refused, not turned into one."""

    def to_internal_value(self, data):
        if not isinstance(data, str):
            self.fail("invalid")
        return super().to_internal_value(data)


class ProposeInputSerializer(FenceSerializer):
    tool = serializers.CharField(max_length=60, help_text="A tool of the agent's manifest.")
    arguments = serializers.DictField(help_text="Checked against the tool's argument schema.")
    precondition = serializers.CharField(
        max_length=128,
        required=False,
        allow_blank=True,
        default="",
        help_text="For tools declaring a precondition: a fingerprint of the world the call "
        "assumes (an approval binds to it; dispatch re-checks it).",
    )
    client_call_id = ClientCallIdField(
        remote.CLIENT_CALL_ID_PATTERN,
        max_length=remote.CLIENT_CALL_ID_MAX,
        required=False,
        default="",
        help_text="Optional: your own id for this call (your framework's tool-call id: 1 to "
        "200 printable ASCII characters, no spaces), unique in the run. Proposed again, it "
        "answers the call first proposed under it (200, whatever its status since) and never "
        "records a second; with another tool or other arguments it is 409 "
        "client_call_id_conflict.",
    )

    def validate_arguments(self, value):
        return json_value(value)


class ProposalSerializer(serializers.Serializer):
    decision = serializers.ChoiceField(
        choices=[
            "approved",
            "awaiting_approval",
            "refused",
            "paused",
            "unknown",
            "succeeded",
            "rejected",
            "failed",
            "cancelled",
        ],
        help_text="approved: dispatch it. awaiting_approval: the lease is released until a "
        "person decides. refused: a failed step (see error). paused: the principal may not "
        "use the tool. unknown/succeeded: a fork inherited this call's key — or, for a "
        "client_call_id proposed again, what became of its call, as do rejected (an approver "
        "refused it, or its approval expired), failed (the tool answered failed) and "
        "cancelled.",
    )
    step_seq = serializers.IntegerField(source="step.seq")
    error = serializers.CharField(allow_blank=True)
    approval = serializers.IntegerField(source="approval_id", allow_null=True)
    tool_call = serializers.SerializerMethodField()

    @extend_schema_field(ToolCallSerializer(allow_null=True))
    def get_tool_call(self, proposal) -> dict | None:
        return ToolCallSerializer(proposal.call).data if proposal.call is not None else None


class ProposeApi(APIView):
    @extend_schema(
        summary="Propose a tool call; the tool's approval policy decides",
        request=ProposeInputSerializer,
        responses={
            201: OpenApiResponse(ProposalSerializer, description="Proposed."),
            200: OpenApiResponse(
                ProposalSerializer,
                description="A retry (same fence, tool and arguments) of a propose that was "
                "recorded: the same call, still open. Or a client_call_id proposed before: "
                "its call, as it stands.",
            ),
            **errors(
                "validation_error",
                "not_found",
                "invalid_state",
                "lease_lost",
                "lease_not_yours",
                "budget_exhausted",
                "client_call_id_conflict",
            ),
        },
    )
    def post(self, request, run_id):
        data = request_data(ProposeInputSerializer, request)
        proposal = remote.remote_toolcall_propose(
            run_id=run_id,
            **lease_proof(data),
            actor=actor_for(request),
            tool=data["tool"],
            arguments=data["arguments"],
            precondition=data["precondition"],
            client_call_id=data["client_call_id"],
        )
        return recorded_response(ProposalSerializer(proposal).data, replayed=proposal.replayed)


class DispatchInputSerializer(FenceSerializer):
    precondition = serializers.CharField(
        max_length=128,
        required=False,
        allow_blank=True,
        default="",
        help_text="The precondition's fingerprint now (tools declaring one).",
    )


class DispatchSerializer(serializers.Serializer):
    go = serializers.BooleanField(
        help_text="true: call the tool now, with this key (unless execute is false)."
    )
    dry_run = serializers.BooleanField(help_text=DRY_RUN_HELP)
    execute = serializers.BooleanField(
        help_text="false: do not execute — a dry run's call of a tool that is not read. Report "
        "what the call would do as its receipt (outcome succeeded); it is recorded as simulated."
    )
    reason = serializers.CharField(allow_blank=True)
    replayed = serializers.BooleanField(
        help_text="true: a repeated dispatch by the same fence, answered with the original "
        "dispatch (same attempt, same deadlines)."
    )
    fence = serializers.IntegerField(
        source="call.dispatch_incarnation",
        allow_null=True,
        help_text="The fence that dispatched the call (send it with the request as well).",
    )
    idempotency_key = serializers.CharField(source="call.idempotency_key")
    attempt = serializers.IntegerField(source="call.attempt_count")
    arguments = serializers.JSONField(
        source="call.arguments", help_text="The arguments to send (an approver may have edited)."
    )
    dispatched_at = serializers.DateTimeField(
        source="call.dispatched_at", allow_null=True, help_text="Database time."
    )
    send_deadline = serializers.DateTimeField(
        source="call.send_deadline",
        allow_null=True,
        help_text="Database time: no byte of the request may leave after it. Ask "
        "POST /tool-calls/{id}/send-check/ immediately before sending.",
    )
    landing_deadline = serializers.DateTimeField(
        source="call.landing_deadline",
        allow_null=True,
        help_text="Database time: until when the request may still land (send deadline + "
        "the tool's total timeout + a margin). A re-send needs a lookup begun after it.",
    )
    timeout_seconds = serializers.FloatField(
        source="timeout",
        allow_null=True,
        help_text="The tool's total timeout: the whole call, connection set-up included. "
        "Start counting it before sending the dispatch request.",
    )
    tool_call = ToolCallSerializer(source="call")


class DispatchApi(APIView):
    @extend_schema(
        summary="Mark a call dispatching (consumes its approval); get its key and deadlines",
        request=DispatchInputSerializer,
        responses={
            200: DispatchSerializer,
            **errors(
                "validation_error",
                "not_found",
                "invalid_state",
                "lease_lost",
                "lease_not_yours",
                "reconcile_required",
                "dispatch_too_early",
                "at_capacity",
            ),
        },
    )
    def post(self, request, tool_call_id):
        data = request_data(DispatchInputSerializer, request)
        dispatch = remote.remote_toolcall_dispatch(
            tool_call_id=tool_call_id,
            **lease_proof(data),
            actor=actor_for(request),
            precondition=data["precondition"],
        )
        return Response(DispatchSerializer(dispatch).data)


class SendCheckInputSerializer(FenceSerializer):
    attempt = serializers.IntegerField(
        min_value=1, max_value=MAX_SEQ, help_text="The attempt dispatch answered."
    )


class SendCheckSerializer(serializers.Serializer):
    tool_call = serializers.IntegerField(source="tool_call_id")
    fence = serializers.IntegerField()
    attempt = serializers.IntegerField()
    dispatched_at = serializers.DateTimeField()
    send_deadline = serializers.DateTimeField(
        help_text="Database time: the request's last byte must leave before it."
    )
    landing_deadline = serializers.DateTimeField()
    checked_at = serializers.DateTimeField(help_text="The database's time at the check.")
    send_seconds_left = serializers.FloatField(
        help_text="send_deadline - checked_at: count it from before this request was sent."
    )


class SendCheckApi(APIView):
    @extend_schema(
        summary="Pre-send check: may this dispatch's request leave now? (call it just before)",
        description="One query checks that the fence still holds the running run, the call is "
        "still that fence's dispatch `attempt`, and the database's clock is before the send "
        "deadline. Refused (`lease_lost`, `send_deadline_passed`, `invalid_state`): do not "
        "send; report `not_sent` and reconcile. Writes nothing.",
        request=SendCheckInputSerializer,
        responses={
            200: SendCheckSerializer,
            **errors(
                "validation_error",
                "not_found",
                "invalid_state",
                "lease_lost",
                "lease_not_yours",
                "send_deadline_passed",
            ),
        },
    )
    def post(self, request, tool_call_id):
        data = request_data(SendCheckInputSerializer, request)
        clearance = remote.remote_toolcall_send_check(
            tool_call_id=tool_call_id,
            **lease_proof(data),
            attempt=data["attempt"],
            actor=actor_for(request),
        )
        return Response(SendCheckSerializer(clearance).data)


class LookupSerializer(serializers.Serializer):
    tool_call = serializers.IntegerField(source="call.id")
    lookup = serializers.IntegerField(
        source="number", help_text="Name it in the receipt that reports what this lookup found."
    )
    started_at = serializers.DateTimeField(help_text="Database time the lookup began.")
    resend_after = serializers.DateTimeField(
        allow_null=True,
        help_text="The call's landing deadline: only a lookup begun after it may report "
        "absent. null: the downstream deduplicates by key (any lookup may).",
    )
    absent_allows_resend = serializers.BooleanField(
        help_text="false: this lookup began too early; an absent from it is refused "
        "(lookup_too_early). A found still counts."
    )
    idempotency_key = serializers.CharField(source="call.idempotency_key")


class LookupApi(APIView):
    @extend_schema(
        summary="Begin a reconciliation lookup (before looking the key up)",
        description="Records, in database time, that a lookup of the call's key is beginning. "
        "Begin it before sending the lookup to the external system, and name its number in the "
        "receipt that reports what it found.",
        request=FenceSerializer,
        responses={
            201: LookupSerializer,
            **errors(
                "validation_error", "not_found", "invalid_state", "lease_lost", "lease_not_yours"
            ),
        },
    )
    def post(self, request, tool_call_id):
        data = request_data(FenceSerializer, request)
        begun = remote.remote_toolcall_lookup_begin(
            tool_call_id=tool_call_id, **lease_proof(data), actor=actor_for(request)
        )
        return Response(LookupSerializer(begun).data, status=status.HTTP_201_CREATED)


class ReceiptInputSerializer(FenceSerializer):
    outcome = serializers.ChoiceField(
        choices=remote.RECEIPT_OUTCOMES,
        help_text="succeeded / failed: the tool (or the lookup) answered. unknown: it timed out "
        "or failed ambiguously; reconcile next. not_sent (source agent): the pre-send check "
        "refused and the request never left (reconciled as unknown all the same). absent "
        "(source reconciliation, with lookup): the lookup reliably found nothing under the key.",
    )
    source = serializers.ChoiceField(choices=["agent", "reconciliation"], default="agent")
    lookup = serializers.IntegerField(
        min_value=1,
        max_value=MAX_SEQ,
        required=False,
        allow_null=True,
        default=None,
        help_text="Reconciliation: the lookup (POST /tool-calls/{id}/lookups/) whose answer "
        "this is. Required with absent.",
    )
    result = serializers.JSONField(required=False, allow_null=True, default=None)
    external_ref = serializers.CharField(
        max_length=200, required=False, allow_blank=True, default=""
    )
    state = serializers.DictField(
        required=False, help_text="The run's new state with the outcome applied."
    )

    def validate_result(self, value):
        return json_value(value)

    def validate_state(self, value):
        return json_value(value)


class ReceiptSerializer(ToolCallSerializer):
    run_status = serializers.SerializerMethodField(
        help_text="The run's status after the receipt: running (go on), or needs_attention "
        "(an unknown outcome for a person; resend: person), paused, terminated: stop."
    )

    class Meta(ToolCallSerializer.Meta):
        fields = [*ToolCallSerializer.Meta.fields, "run_status"]
        read_only_fields = fields

    def get_run_status(self, call) -> str:
        return Run.objects.values_list("status", flat=True).get(id=call.run_id)


class ReceiptApi(APIView):
    @extend_schema(
        summary="Record a dispatched call's outcome (from the tool or a reconciliation lookup)",
        request=ReceiptInputSerializer,
        responses={
            200: ReceiptSerializer,
            **errors(
                "validation_error",
                "lookup_required",
                "not_found",
                "invalid_state",
                "lease_lost",
                "lease_not_yours",
                "lookup_too_early",
                "lookup_superseded",
            ),
        },
    )
    def post(self, request, tool_call_id):
        data = request_data(ReceiptInputSerializer, request)
        remote.remote_toolcall_receipt(
            tool_call_id=tool_call_id,
            **lease_proof(data),
            actor=actor_for(request),
            outcome=data["outcome"],
            source=data["source"],
            result=data["result"],
            external_ref=data["external_ref"],
            state=data.get("state"),
            lookup=data["lookup"],
        )
        return Response(ReceiptSerializer(selectors.toolcalls_for_api().get(id=tool_call_id)).data)

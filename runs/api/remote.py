# size: the remote-agent protocol's endpoints (lease, steps, calls, waits), signals and manifests
# with their serializers, one view each; to split by concern (waits, signals, agents) once the
# branches that change it have merged
"""The remote-agent protocol (``runs.remote``), signals, and remote agents' manifests.

Every write of the lease holder carries ``fence`` and ``lease_token`` in its body; a stale
fence (or an expired or released lease) is ``409 lease_lost``, another claim's token or
principal ``403 lease_not_yours``, and either changes nothing.
"""

from __future__ import annotations

from decimal import Decimal
from typing import Any

from django.contrib.auth.models import Group
from drf_spectacular.utils import (
    OpenApiParameter,
    OpenApiResponse,
    PolymorphicProxySerializer,
    extend_schema,
    extend_schema_field,
)
from rest_framework import serializers, status
from rest_framework.response import Response
from rest_framework.views import APIView

from runs import remote, selectors
from runs.api import (
    AgentSerializer,
    RunSerializer,
    ToolCallSerializer,
    _reject_null_characters,
    agent_data,
)
from runs.api_common import ApiError, actor_for, errors
from runs.models import AgentManifest, Run, Signal, Step, ToolCall
from runs.registry import AskQuestion, OnExpiry, Sleep, UnknownAgent, WaitForSignal, registry
from runs.waits import ANSWER_MAX, run_signal

# signal names are identifiers: what a wait's code names, safe in logs and URLs
SIGNAL_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.:-]{0,99}$"
FENCE_HELP = "The fence returned by POST /lease/: proves this process still holds the lease."
LEASE_TOKEN_HELP = (
    "The lease_token returned by POST /lease/ with this fence: proves this process is the one "
    "the claim answered (the fence alone is visible to every viewer of the run)."
)
MAX_FENCE = 2**63 - 1
MAX_SEQ = 2**31 - 1
# ten years: longer waits are better modelled as a signal with no timeout
MAX_WAIT_SECONDS = 10 * 365 * 24 * 3600
SEQ_HELP = (
    "Optional: the step number this request should get (the last step's seq + 1). A retry "
    "with the same seq by the same fence gets the step its first attempt recorded (200) "
    "instead of a second one; any other seq than the next is invalid_state."
)


def _json_value(value: Any) -> Any:
    _reject_null_characters(value)
    return value


def _input(serializer: type[serializers.Serializer], request) -> dict[str, Any]:
    """The request's body, validated by ``serializer`` (else ``validation_error``)."""
    payload = serializer(data=request.data)
    payload.is_valid(raise_exception=True)
    return payload.validated_data


def _recorded(body: Any, *, replayed: bool) -> Response:
    """201 for what this request recorded; 200 for a retry answered with what its first
    attempt recorded (a step, a proposal, a wait)."""
    return Response(body, status=status.HTTP_200_OK if replayed else status.HTTP_201_CREATED)


class ClientCallIdField(serializers.RegexField):
    """A string and only a string: an id sent as a number is refused, not turned into one."""

    def to_internal_value(self, data):
        if not isinstance(data, str):
            self.fail("invalid")
        return super().to_internal_value(data)


class FenceSerializer(serializers.Serializer):
    fence = serializers.IntegerField(min_value=1, max_value=MAX_FENCE, help_text=FENCE_HELP)
    lease_token = serializers.CharField(
        min_length=1, max_length=200, trim_whitespace=False, help_text=LEASE_TOKEN_HELP
    )


def _lease(data: dict[str, Any]) -> dict[str, Any]:
    """The holder's proof, as every fenced service takes it."""
    return {"fence": data["fence"], "lease_token": data["lease_token"]}


# --- lease ---------------------------------------------------------------------------------------


class LeaseInputSerializer(serializers.Serializer):
    owner = serializers.CharField(
        max_length=100,
        required=False,
        allow_blank=True,
        default="",
        help_text="A name for this process (host, pid): shown as the lease owner.",
    )


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


class ResumeStepSerializer(serializers.Serializer):
    seq = serializers.IntegerField()
    kind = serializers.CharField()
    status = serializers.CharField()
    input = serializers.JSONField()
    output = serializers.JSONField(
        allow_null=True,
        help_text="A wait's outcome: the signal's payload, the answer, {until} for a timer, "
        "or the wait's default when it timed out.",
    )
    error = serializers.CharField(allow_blank=True)
    wait = WaitOutcomeSerializer(allow_null=True, help_text="Wait steps: how the wait ended.")


class ResumeCallSerializer(serializers.Serializer):
    id = serializers.IntegerField()
    step_seq = serializers.IntegerField()
    tool = serializers.CharField(help_text="The tool's name in the manifest.")
    tool_version = serializers.CharField()
    arguments = serializers.JSONField(help_text="The real arguments (the lease holder's own).")
    status = serializers.ChoiceField(choices=ToolCall.Status.choices)
    idempotency_key = serializers.CharField(help_text="Pass it to the real tool.")
    client_call_id = serializers.CharField(
        allow_blank=True, help_text="The agent's own id for the call, given at propose (or empty)."
    )
    attempt_count = serializers.IntegerField()
    dispatched_at = serializers.DateTimeField(allow_null=True)
    landing_deadline = serializers.DateTimeField(
        allow_null=True,
        help_text="Unknown outcomes: only a lookup begun after it may report absent.",
    )
    send_deadline = serializers.DateTimeField(
        allow_null=True,
        help_text="A dispatched call: no byte of the request may be sent after it.",
    )
    resend_after = serializers.DateTimeField(
        allow_null=True,
        help_text="A dispatching or unknown call: a lookup that reports it absent must begin "
        "after this (its landing deadline); before, the request may still land.",
    )
    lookups_begun = serializers.IntegerField()
    last_error = serializers.CharField(allow_blank=True)
    approval = serializers.IntegerField(allow_null=True)


class ResumeApprovalSerializer(serializers.Serializer):
    id = serializers.IntegerField()
    tool_call = serializers.IntegerField()


class ResumeMigrationSerializer(serializers.Serializer):
    to = serializers.CharField()
    description = serializers.CharField(allow_null=True, allow_blank=True)

    def to_representation(self, instance):
        return {
            "from": instance["from"],
            "to": instance["to"],
            "description": instance.get("description"),
        }


DRY_RUN_HELP = (
    "A dry run: call no tool that is not read. For each such call, dispatch it as usual, "
    "do NOT execute it, and report what it would do as its receipt (recorded as simulated). "
    "The guarantee rests on this process: the server cannot stop it from calling a tool."
)


class ResumeSerializer(serializers.Serializer):
    run = serializers.UUIDField()
    agent = serializers.CharField()
    agent_version = serializers.CharField()
    goal = serializers.CharField(allow_blank=True)
    dry_run = serializers.BooleanField(help_text=DRY_RUN_HELP)
    input = serializers.JSONField()
    state = serializers.JSONField()
    state_version = serializers.IntegerField()
    recovery_count = serializers.IntegerField()
    next_seq = serializers.IntegerField(help_text="The seq of the next step to write.")
    steps = ResumeStepSerializer(many=True, help_text="Finished steps, in order.")
    open_tool_calls = ResumeCallSerializer(many=True)
    unknown_outcomes = ResumeCallSerializer(
        many=True,
        help_text="Calls whose outcome is unknown (a call left dispatching by a process that "
        "died is one): reconcile each by its idempotency key; never just dispatch it again.",
    )
    pending_approvals = ResumeApprovalSerializer(many=True)
    migrated_from = serializers.CharField(
        allow_null=True, help_text="Set when the run moved to a new agent version at this claim."
    )
    migrations = serializers.ListField(
        child=serializers.DictField(), help_text="The version hops to apply to the state."
    )


class LeaseSerializer(serializers.Serializer):
    run = serializers.UUIDField(source="run_id")
    fence = serializers.IntegerField()
    lease_token = serializers.CharField(
        help_text="A secret for this claim, shown only here (the server keeps its hash): send "
        "it with the fence in every write of this lease. Keep it out of logs and never pass "
        "it to a tool."
    )
    lease_expires_at = serializers.DateTimeField()
    lease_ttl_seconds = serializers.FloatField(
        help_text="Heartbeat well within this (a third of it is a good interval)."
    )
    dry_run = serializers.BooleanField(source="resume.dry_run", help_text=DRY_RUN_HELP)
    resume = ResumeSerializer()


class LeaseStatusSerializer(serializers.Serializer):
    run = serializers.UUIDField(source="id")
    status = serializers.CharField()
    fence = serializers.IntegerField()
    lease_expires_at = serializers.DateTimeField(allow_null=True)
    requested_action = serializers.CharField(
        allow_blank=True,
        help_text="pause or terminate: finish the call in flight, record its receipt, and the "
        "run stops there.",
    )


class LeaseApi(APIView):
    @extend_schema(
        summary="Claim a remote run's lease and get its resume packet",
        request=LeaseInputSerializer,
        responses={
            200: LeaseSerializer,
            **errors("validation_error", "not_found", "invalid_state", "lease_held"),
        },
    )
    def post(self, request, run_id):
        data = _input(LeaseInputSerializer, request)
        grant = remote.remote_lease_acquire(
            run_id=run_id, actor=actor_for(request), owner=data["owner"]
        )
        return Response(LeaseSerializer(grant).data)


class LeaseHeartbeatApi(APIView):
    @extend_schema(
        summary="Extend the lease (send well within its time to live)",
        request=FenceSerializer,
        responses={
            200: LeaseStatusSerializer,
            **errors(
                "validation_error", "not_found", "invalid_state", "lease_lost", "lease_not_yours"
            ),
        },
    )
    def post(self, request, run_id):
        data = _input(FenceSerializer, request)
        run = remote.remote_lease_heartbeat(run_id=run_id, **_lease(data), actor=actor_for(request))
        return Response(LeaseStatusSerializer(run).data)


class LeaseReleaseApi(APIView):
    @extend_schema(
        summary="Give the lease back (the run waits for an agent process)",
        request=FenceSerializer,
        responses={
            200: LeaseStatusSerializer,
            **errors(
                "validation_error", "not_found", "invalid_state", "lease_lost", "lease_not_yours"
            ),
        },
    )
    def post(self, request, run_id):
        data = _input(FenceSerializer, request)
        run = remote.remote_lease_release(run_id=run_id, **_lease(data), actor=actor_for(request))
        return Response(LeaseStatusSerializer(run).data)


# --- steps and tool calls --------------------------------------------------------------------------


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
        return _json_value(value)

    def validate_output(self, value):
        return _json_value(value)

    def validate_state(self, value):
        return _json_value(value)


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
        data = _input(StepInputSerializer, request)
        recorded = remote.remote_step_record(
            run_id=run_id,
            **_lease(data),
            actor=actor_for(request),
            input=data["input"],
            output=data["output"],
            state=data.get("state"),
            cost=Decimal(str(data["cost"])).quantize(Decimal("0.000001")),
            tokens=data["tokens"],
            seq=data.get("seq"),
        )
        return _recorded(StepSerializer(recorded.step).data, replayed=recorded.replayed)


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
        return _json_value(value)


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
        data = _input(ProposeInputSerializer, request)
        proposal = remote.remote_toolcall_propose(
            run_id=run_id,
            **_lease(data),
            actor=actor_for(request),
            tool=data["tool"],
            arguments=data["arguments"],
            precondition=data["precondition"],
            client_call_id=data["client_call_id"],
        )
        return _recorded(ProposalSerializer(proposal).data, replayed=proposal.replayed)


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
        data = _input(DispatchInputSerializer, request)
        dispatch = remote.remote_toolcall_dispatch(
            tool_call_id=tool_call_id,
            **_lease(data),
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
        data = _input(SendCheckInputSerializer, request)
        clearance = remote.remote_toolcall_send_check(
            tool_call_id=tool_call_id,
            **_lease(data),
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
        data = _input(FenceSerializer, request)
        begun = remote.remote_toolcall_lookup_begin(
            tool_call_id=tool_call_id, **_lease(data), actor=actor_for(request)
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
        return _json_value(value)

    def validate_state(self, value):
        return _json_value(value)


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
        data = _input(ReceiptInputSerializer, request)
        remote.remote_toolcall_receipt(
            tool_call_id=tool_call_id,
            **_lease(data),
            actor=actor_for(request),
            outcome=data["outcome"],
            source=data["source"],
            result=data["result"],
            external_ref=data["external_ref"],
            state=data.get("state"),
            lookup=data["lookup"],
        )
        return Response(ReceiptSerializer(selectors.toolcalls_for_api().get(id=tool_call_id)).data)


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
        return _json_value(value)


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
        data = _input(FinishInputSerializer, request)
        run = remote.remote_run_finish(
            run_id=run_id,
            **_lease(data),
            actor=actor_for(request),
            status=data["status"],
            result=data["result"],
            reason=data["reason"],
        )
        return Response(RunSerializer(selectors.run_get(run_id=run.id)).data)


# --- durable waits (docs/waits.md) ----------------------------------------------------------------


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
        return _json_value(value)


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
        return _json_value(value)

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
        data = _input(serializer, request)
        begun = remote.remote_wait_begin(
            run_id=run_id,
            **_lease(data),
            actor=actor_for(request),
            action=_wait_action(data),
            seq=data.get("seq"),
        )
        return _recorded(WaitSerializer(begun).data, replayed=begun.replayed)


# --- signals (issue 5) ----------------------------------------------------------------------------


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
        return _json_value(value)

    def validate_idempotency_key(self, value):
        return _json_value(value)


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
        data = _input(SignalInputSerializer, request)
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


# --- one agent; remote manifests -------------------------------------------------------------------


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

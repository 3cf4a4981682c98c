"""The remote-agent protocol (``runs.remote``), signals, and remote agents' manifests.

Every write of the lease holder carries ``fence`` in its body; a stale fence (or an expired
or released lease) is ``409 lease_lost`` and changes nothing.
"""

from __future__ import annotations

from decimal import Decimal
from typing import Any

from drf_spectacular.utils import (
    OpenApiParameter,
    OpenApiResponse,
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
from runs.registry import UnknownAgent, registry
from runs.waits import run_signal

# signal names are identifiers: what a wait's code names, safe in logs and URLs
SIGNAL_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.:-]{0,99}$"
FENCE_HELP = "The fence returned by POST /lease/: proves this process still holds the lease."
MAX_FENCE = 2**63 - 1


def _json_value(value: Any) -> Any:
    _reject_null_characters(value)
    return value


class FenceSerializer(serializers.Serializer):
    fence = serializers.IntegerField(min_value=1, max_value=MAX_FENCE, help_text=FENCE_HELP)


# --- lease ---------------------------------------------------------------------------------------


class LeaseInputSerializer(serializers.Serializer):
    owner = serializers.CharField(
        max_length=100,
        required=False,
        allow_blank=True,
        default="",
        help_text="A name for this process (host, pid): shown as the lease owner.",
    )


class ResumeStepSerializer(serializers.Serializer):
    seq = serializers.IntegerField()
    kind = serializers.CharField()
    status = serializers.CharField()
    input = serializers.JSONField()
    output = serializers.JSONField(allow_null=True)
    error = serializers.CharField(allow_blank=True)


class ResumeCallSerializer(serializers.Serializer):
    id = serializers.IntegerField()
    step_seq = serializers.IntegerField()
    tool = serializers.CharField(help_text="The tool's name in the manifest.")
    tool_version = serializers.CharField()
    arguments = serializers.JSONField(help_text="The real arguments (the lease holder's own).")
    status = serializers.ChoiceField(choices=ToolCall.Status.choices)
    idempotency_key = serializers.CharField(help_text="Pass it to the real tool.")
    attempt_count = serializers.IntegerField()
    dispatched_at = serializers.DateTimeField(allow_null=True)
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


class ResumeSerializer(serializers.Serializer):
    run = serializers.UUIDField()
    agent = serializers.CharField()
    agent_version = serializers.CharField()
    goal = serializers.CharField(allow_blank=True)
    input = serializers.JSONField()
    state = serializers.JSONField()
    state_version = serializers.IntegerField()
    recovery_count = serializers.IntegerField()
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
    lease_expires_at = serializers.DateTimeField()
    lease_ttl_seconds = serializers.FloatField(
        help_text="Heartbeat well within this (a third of it is a good interval)."
    )
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
        payload = LeaseInputSerializer(data=request.data)
        payload.is_valid(raise_exception=True)
        grant = remote.remote_lease_acquire(
            run_id=run_id, actor=actor_for(request), owner=payload.validated_data["owner"]
        )
        return Response(LeaseSerializer(grant).data)


class LeaseHeartbeatApi(APIView):
    @extend_schema(
        summary="Extend the lease (send well within its time to live)",
        request=FenceSerializer,
        responses={
            200: LeaseStatusSerializer,
            **errors("validation_error", "not_found", "invalid_state", "lease_lost"),
        },
    )
    def post(self, request, run_id):
        payload = FenceSerializer(data=request.data)
        payload.is_valid(raise_exception=True)
        run = remote.remote_lease_heartbeat(
            run_id=run_id, fence=payload.validated_data["fence"], actor=actor_for(request)
        )
        return Response(LeaseStatusSerializer(run).data)


class LeaseReleaseApi(APIView):
    @extend_schema(
        summary="Give the lease back (the run waits for an agent process)",
        request=FenceSerializer,
        responses={
            200: LeaseStatusSerializer,
            **errors("validation_error", "not_found", "invalid_state", "lease_lost"),
        },
    )
    def post(self, request, run_id):
        payload = FenceSerializer(data=request.data)
        payload.is_valid(raise_exception=True)
        run = remote.remote_lease_release(
            run_id=run_id, fence=payload.validated_data["fence"], actor=actor_for(request)
        )
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
            201: StepSerializer,
            **errors(
                "validation_error", "not_found", "invalid_state", "lease_lost", "budget_exhausted"
            ),
        },
    )
    def post(self, request, run_id):
        payload = StepInputSerializer(data=request.data)
        payload.is_valid(raise_exception=True)
        data = payload.validated_data
        step = remote.remote_step_record(
            run_id=run_id,
            fence=data["fence"],
            actor=actor_for(request),
            input=data["input"],
            output=data["output"],
            state=data.get("state"),
            cost=Decimal(str(data["cost"])).quantize(Decimal("0.000001")),
            tokens=data["tokens"],
        )
        return Response(StepSerializer(step).data, status=status.HTTP_201_CREATED)


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

    def validate_arguments(self, value):
        return _json_value(value)


class ProposalSerializer(serializers.Serializer):
    decision = serializers.ChoiceField(
        choices=["approved", "awaiting_approval", "refused", "paused", "unknown", "succeeded"],
        help_text="approved: dispatch it. awaiting_approval: the lease is released until a "
        "person decides. refused: a failed step (see error). paused: the principal may not "
        "use the tool. unknown/succeeded: a fork inherited this call's key.",
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
            201: ProposalSerializer,
            **errors(
                "validation_error", "not_found", "invalid_state", "lease_lost", "budget_exhausted"
            ),
        },
    )
    def post(self, request, run_id):
        payload = ProposeInputSerializer(data=request.data)
        payload.is_valid(raise_exception=True)
        data = payload.validated_data
        proposal = remote.remote_toolcall_propose(
            run_id=run_id,
            fence=data["fence"],
            actor=actor_for(request),
            tool=data["tool"],
            arguments=data["arguments"],
            precondition=data["precondition"],
        )
        return Response(ProposalSerializer(proposal).data, status=status.HTTP_201_CREATED)


class DispatchInputSerializer(FenceSerializer):
    precondition = serializers.CharField(
        max_length=128,
        required=False,
        allow_blank=True,
        default="",
        help_text="The precondition's fingerprint now (tools declaring one).",
    )


class DispatchSerializer(serializers.Serializer):
    go = serializers.BooleanField(help_text="true: call the tool now, with this key.")
    reason = serializers.CharField(allow_blank=True)
    idempotency_key = serializers.CharField(source="call.idempotency_key")
    attempt = serializers.IntegerField(source="call.attempt_count")
    arguments = serializers.JSONField(
        source="call.arguments", help_text="The arguments to send (an approver may have edited)."
    )
    tool_call = ToolCallSerializer(source="call")


class DispatchApi(APIView):
    @extend_schema(
        summary="Mark a call dispatching (consumes its approval) and get its idempotency key",
        request=DispatchInputSerializer,
        responses={
            200: DispatchSerializer,
            **errors("validation_error", "not_found", "invalid_state", "lease_lost"),
        },
    )
    def post(self, request, tool_call_id):
        payload = DispatchInputSerializer(data=request.data)
        payload.is_valid(raise_exception=True)
        dispatch = remote.remote_toolcall_dispatch(
            tool_call_id=tool_call_id,
            fence=payload.validated_data["fence"],
            actor=actor_for(request),
            precondition=payload.validated_data["precondition"],
        )
        return Response(DispatchSerializer(dispatch).data)


class ReceiptInputSerializer(FenceSerializer):
    outcome = serializers.ChoiceField(
        choices=remote.RECEIPT_OUTCOMES,
        help_text="succeeded / failed: the tool (or the lookup) answered. unknown: it timed out "
        "or failed ambiguously; reconcile next. absent (source reconciliation): the lookup "
        "reliably found nothing under the key.",
    )
    source = serializers.ChoiceField(choices=["agent", "reconciliation"], default="agent")
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


class ReceiptApi(APIView):
    @extend_schema(
        summary="Record a dispatched call's outcome (from the tool or a reconciliation lookup)",
        request=ReceiptInputSerializer,
        responses={
            200: ToolCallSerializer,
            **errors("validation_error", "not_found", "invalid_state", "lease_lost"),
        },
    )
    def post(self, request, tool_call_id):
        payload = ReceiptInputSerializer(data=request.data)
        payload.is_valid(raise_exception=True)
        data = payload.validated_data
        remote.remote_toolcall_receipt(
            tool_call_id=tool_call_id,
            fence=data["fence"],
            actor=actor_for(request),
            outcome=data["outcome"],
            source=data["source"],
            result=data["result"],
            external_ref=data["external_ref"],
            state=data.get("state"),
        )
        return Response(ToolCallSerializer(selectors.toolcalls_for_api().get(id=tool_call_id)).data)


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
            **errors("validation_error", "not_found", "invalid_state", "lease_lost"),
        },
    )
    def post(self, request, run_id):
        payload = FinishInputSerializer(data=request.data)
        payload.is_valid(raise_exception=True)
        data = payload.validated_data
        run = remote.remote_run_finish(
            run_id=run_id,
            fence=data["fence"],
            actor=actor_for(request),
            status=data["status"],
            result=data["result"],
            reason=data["reason"],
        )
        return Response(RunSerializer(selectors.run_get(run_id=run.id)).data)


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
        payload = SignalInputSerializer(data=request.data)
        payload.is_valid(raise_exception=True)
        data = payload.validated_data
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
    on_expiry = serializers.ChoiceField(choices=["reject", "terminate", "escalate"], required=False)


class ManifestToolSerializer(serializers.Serializer):
    name = serializers.CharField(max_length=60)
    version = serializers.CharField(max_length=64, required=False)
    description = serializers.CharField(required=False, allow_blank=True)
    effect = serializers.ChoiceField(choices=["read", "idempotent", "reconcilable", "unsafe"])
    argument_schema = serializers.DictField(required=False, help_text="A JSON Schema (an object).")
    sensitive_fields = serializers.ListField(child=serializers.CharField(), required=False)
    approval = ManifestApprovalSerializer(required=False)
    timeout = serializers.FloatField(required=False, min_value=0.001, max_value=86400)
    allowed_groups = serializers.ListField(child=serializers.CharField(), required=False)
    precondition = serializers.BooleanField(required=False)


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

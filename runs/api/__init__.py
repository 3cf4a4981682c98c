# size: the runs API's own use cases (runs, events, calls, agents) with their serializers, one
# view each; the remote protocol, history, questions and the schema's hooks are modules beside it
"""The runs API (``/api/v1/``): one view per use case, input and output serializers.

Views parse, call the same services the pages and the admin call, and serialize. Services
check permissions and raise domain errors; ``runs.api.common.exception_handler`` turns each
into ``{"code", "detail"}`` with its status.
"""

from __future__ import annotations

from typing import Any

from django.db import connection
from django.utils import timezone
from drf_spectacular.utils import (
    OpenApiResponse,
    extend_schema,
    extend_schema_field,
    inline_serializer,
)
from rest_framework import generics, serializers, status
from rest_framework.permissions import AllowAny
from rest_framework.response import Response
from rest_framework.views import APIView

from runs import selectors, services
from runs.api import longpoll
from runs.api.common import (
    IDEMPOTENCY_KEY_HEADER,
    ApiError,
    CanReadRuns,
    CanReadToolCalls,
    CreatedCursorPagination,
    IdCursorPagination,
    QueryParamsSerializer,
    SeqPagination,
    StrictBooleanField,
    StrictCharField,
    actor_for,
    errors,
    readable,
)
from runs.idempotency import run_create_idempotent
from runs.masking import Masker, maskers_for_ids
from runs.models import AgentManifest, Run, RunEvent, ToolCall
from runs.registry import Agent, Tool, registry
from runs.remote import RemoteAgent, manifest_tool

# --- validation helpers --------------------------------------------------------------------


def _reject_null_characters(value: Any, path: str = "") -> None:
    """PostgreSQL cannot store U+0000 in text or jsonb: refuse it as bad input instead of
    failing at insert."""
    if isinstance(value, str):
        if "\x00" in value:
            raise serializers.ValidationError(f"{path or 'value'}: null characters are not allowed")
    elif isinstance(value, dict):
        for key, sub in value.items():
            _reject_null_characters(key, path)
            _reject_null_characters(sub, f"{path}/{key}" if path else str(key))
    elif isinstance(value, list):
        for index, sub in enumerate(value):
            _reject_null_characters(sub, f"{path}/{index}" if path else str(index))


# --- serializers ---------------------------------------------------------------------------


# drf-spectacular documents every decimal as possibly negative ("^-?..."); a cost is not, and
# the schema says what the field accepts: up to 6 digits before the point and 6 after
@extend_schema_field(
    {
        "type": "string",
        "format": "decimal",
        "pattern": r"^(?:\d{1,6}(?:\.\d{0,6})?|\.\d{1,6})$",
        "nullable": True,
        "example": "2.50",
    }
)
class CostField(serializers.DecimalField):
    def __init__(self, **kwargs):
        super().__init__(max_digits=12, decimal_places=6, min_value=0, allow_null=True, **kwargs)


class BudgetSerializer(serializers.Serializer):
    max_steps = serializers.IntegerField(min_value=1, max_value=1_000_000, required=False)
    max_cost = CostField(required=False)
    max_tokens = serializers.IntegerField(
        min_value=1, max_value=10**15, required=False, allow_null=True
    )
    deadline = serializers.DateTimeField(required=False, allow_null=True)

    def validate_deadline(self, value):
        if value is not None and value <= timezone.now():
            raise serializers.ValidationError("the deadline must be in the future")
        return value


class RunCreateInputSerializer(serializers.Serializer):
    agent = serializers.CharField(max_length=100, help_text="A name from GET /api/v1/agents/.")
    goal = serializers.CharField(required=False, allow_blank=True, default="", max_length=10_000)
    input = serializers.DictField(
        required=False, default=dict, help_text="Must match the agent's input schema."
    )
    budget = BudgetSerializer(required=False)
    dry_run = serializers.BooleanField(
        required=False,
        default=False,
        help_text="Run the agent for real but call every tool that is not read through its "
        "declared dry_run instead of its side effect (remote agents: every dispatch answer "
        "says do not execute). Refused with dry_run_unsupported, naming the tools, when a "
        "tool that is not read declares no dry run.",
    )

    def validate_input(self, value):
        _reject_null_characters(value)
        return value


class RunListFilterSerializer(QueryParamsSerializer):
    status = serializers.ChoiceField(choices=Run.Status.choices, required=False)
    agent = serializers.CharField(max_length=100, required=False)
    dry_run = serializers.BooleanField(
        required=False, allow_null=True, default=None, help_text="Only dry runs, or only real."
    )


REASON_HELP = "Empty, or why the run stopped or needs a person: " + ", ".join(Run.Reason.values)


class RunSummarySerializer(serializers.ModelSerializer):
    agent = serializers.CharField(source="agent_name")
    # a plain string: the empty value is not one of the choices, and read-only model fields
    # would be documented as the bare enum
    reason_code = serializers.CharField(help_text=REASON_HELP)

    class Meta:
        model = Run
        fields = [
            "id",
            "agent",
            "agent_version",
            "goal",
            "status",
            "reason_code",
            "steps_used",
            "max_steps",
            "recovery_count",
            "dry_run",
            "created_at",
            "updated_at",
        ]
        read_only_fields = fields


class RunUsageSerializer(serializers.Serializer):
    steps = serializers.IntegerField(source="steps_used")
    cost = serializers.DecimalField(source="cost_used", max_digits=12, decimal_places=6)
    tokens = serializers.IntegerField(source="tokens_used")


class RunBudgetOutputSerializer(serializers.Serializer):
    max_steps = serializers.IntegerField(allow_null=True)
    max_cost = serializers.DecimalField(max_digits=12, decimal_places=6, allow_null=True)
    max_tokens = serializers.IntegerField(allow_null=True)
    deadline = serializers.DateTimeField(allow_null=True)


class OpenWaitSerializer(serializers.Serializer):
    """A wait the run is in now (docs/waits.md): what ends it, and when it times out."""

    step = serializers.IntegerField(source="seq")
    kind = serializers.CharField(help_text="signal, timer or question")
    signal = serializers.CharField(allow_null=True, help_text="The signal's name (signal waits).")
    deadline = serializers.DateTimeField(
        allow_null=True, help_text="When it times out (a timer: when it fires); null: never."
    )
    question = serializers.IntegerField(
        allow_null=True, help_text="The question's id (question waits)."
    )
    text = serializers.CharField(allow_null=True, help_text="The question's text.")
    choices = serializers.ListField(child=serializers.CharField(), allow_null=True)
    started_at = serializers.DateTimeField(source="created_at")

    def to_representation(self, step):
        # built here rather than by the fields: each one depends on the kind of wait
        spec = step.input or {}
        kind = spec.get("wait", "")
        question = getattr(step, "question", None) if kind == "question" else None
        return dict(
            step=step.seq,
            started_at=serializers.DateTimeField().to_representation(step.created_at),
            kind=kind,
            signal=spec.get("name") if kind == "signal" else None,
            deadline=spec.get("deadline"),
            question=question.id if question is not None else None,
            text=spec.get("text") if kind == "question" else None,
            choices=spec.get("choices") if kind == "question" else None,
        )


class MaskedSerializerMixin:
    """A serializer of what a run shows: sensitive tool output masked for the viewer
    (runs.masking). The view may pass ``masks`` (run id -> Masker, one query for a page);
    otherwise the masker of each run is built for the context's ``request.user`` — and with
    no request, for nobody in particular (masked)."""

    def mask_for(self, run_id: Any) -> Masker:
        masks = self.context.setdefault("masks", {})
        if run_id not in masks:
            request = self.context.get("request")
            masks.update(maskers_for_ids([run_id], user=getattr(request, "user", None)))
        return masks[run_id]


class RunSerializer(MaskedSerializerMixin, serializers.ModelSerializer):
    agent = serializers.CharField(source="agent_name")
    reason_code = serializers.CharField(help_text=REASON_HELP)
    requested_action = serializers.CharField(
        help_text="Empty, or pause/terminate asked of the process holding the lease."
    )
    principal = serializers.SerializerMethodField()
    open_waits = serializers.SerializerMethodField(
        help_text="The waits the run is in now (a signal, a timer or a question); empty "
        "unless its status is waiting_event."
    )
    budget = RunBudgetOutputSerializer(source="*")
    usage = RunUsageSerializer(source="*")
    root_run = serializers.UUIDField(source="root_run_id", allow_null=True)
    dry_run = serializers.BooleanField(
        help_text="A dry run: its tools that are not read were simulated (receipts with "
        "source simulated), nothing was sent to them."
    )
    promoted_from = serializers.UUIDField(
        source="promoted_from_id",
        allow_null=True,
        help_text="The dry run this run was promoted from (started for real, same input).",
    )
    promoted_to = serializers.SerializerMethodField(
        help_text="A dry run's promotion: the real run started from it, once."
    )
    input = serializers.JSONField()
    state = serializers.JSONField()
    result = serializers.JSONField(allow_null=True)

    class Meta:
        model = Run
        fields = [
            "id",
            "agent",
            "agent_version",
            "goal",
            "input",
            "state",
            "result",
            "status",
            "reason_code",
            "reason_detail",
            "principal",
            "budget",
            "usage",
            "recovery_count",
            "open_waits",
            "requested_action",
            "requested_by",
            "trace_id",
            "root_run",
            "dry_run",
            "promoted_from",
            "promoted_to",
            "event_seq",
            "created_at",
            "updated_at",
            "finished_at",
        ]
        read_only_fields = fields

    def get_principal(self, run: Run) -> str | None:
        return run.principal.get_username() if run.principal_id else None

    @extend_schema_field(serializers.UUIDField(allow_null=True))
    def get_promoted_to(self, run: Run) -> str | None:
        if not run.dry_run:
            return None  # only a dry run is promoted: no lookup for a real one
        promoted = getattr(run, "promoted_to", None)  # select_related by selectors.run_get
        return str(promoted.id) if promoted is not None else None

    @extend_schema_field(OpenWaitSerializer(many=True))
    def get_open_waits(self, run: Run) -> list:
        if run.status != Run.Status.WAITING_EVENT:
            return []
        return OpenWaitSerializer(selectors.open_waits(run_id=run.id), many=True).data

    def to_representation(self, run: Run) -> dict[str, Any]:
        data = super().to_representation(run)
        mask = self.mask_for(run.id)
        for name in ("input", "state", "result", "reason_detail", "open_waits"):
            data[name] = mask(data[name])
        return data


class RunEventSerializer(MaskedSerializerMixin, serializers.ModelSerializer):
    payload = serializers.JSONField(
        help_text="Sensitive arguments are masked at write time; sensitive tool output "
        "(a tool's sensitive_output) when shown, unless you may view it."
    )

    class Meta:
        model = RunEvent
        fields = [
            "seq",
            "type",
            "created_at",
            "actor",
            "channel",
            "incarnation",
            "payload",
            "trace_id",
            "span_id",
            "prev_hash",
            "hash",
        ]
        read_only_fields = fields

    def to_representation(self, event: RunEvent) -> dict[str, Any]:
        data = super().to_representation(event)
        data["payload"] = self.mask_for(event.run_id)(data["payload"])
        return data


class ToolApprovalPolicySerializer(serializers.Serializer):
    when = serializers.CharField(help_text="never, always, or a description of the predicate")
    group = serializers.CharField()
    required = serializers.IntegerField()
    ttl_seconds = serializers.IntegerField()
    on_expiry = serializers.CharField()


class ToolSerializer(serializers.Serializer):
    name = serializers.CharField()
    version = serializers.CharField(
        help_text="the fingerprint recorded on every call of the tool (docs/agents.md)"
    )
    declared_version = serializers.CharField(
        help_text="the version its author declared (part of the fingerprint); may be empty"
    )
    compatible_with = serializers.ListField(
        child=serializers.CharField(),
        help_text="earlier fingerprints declared the same tool on purpose",
    )
    description = serializers.CharField()
    effect = serializers.ChoiceField(choices=["read", "idempotent", "reconcilable", "unsafe"])
    argument_schema = serializers.JSONField()
    sensitive_fields = serializers.ListField(child=serializers.CharField())
    sensitive_output = serializers.ListField(
        child=serializers.CharField(),
        help_text="paths into the result whose values are masked when shown (docs/agents.md)",
    )
    timeout = serializers.FloatField()
    approval = ToolApprovalPolicySerializer()
    dry_run = serializers.BooleanField(
        help_text="Whether a dry run can call it: a read (called for real) or a tool that "
        "declares its dry-run behaviour. A remote agent's tools: true (its process simulates)."
    )


class AgentSerializer(serializers.Serializer):
    name = serializers.CharField()
    version = serializers.CharField()
    kind = serializers.ChoiceField(choices=["hosted", "remote"])
    description = serializers.CharField()
    input_schema = serializers.JSONField()
    tools = ToolSerializer(many=True)


def _tool_data(tool: Tool, *, name: str | None = None, remote: bool = False) -> dict[str, Any]:
    policy = tool.approval
    return {
        "dry_run": remote or tool.simulates,
        "name": name or tool.name,
        "version": tool.version,
        "declared_version": tool.declared_version,
        "compatible_with": list(tool.compatible_with),
        "description": tool.description,
        "effect": str(tool.effect),
        "argument_schema": dict(tool.schema),
        "sensitive_fields": list(tool.sensitive_fields),
        "sensitive_output": list(tool.sensitive_output),
        "timeout": tool.timeout,
        "approval": {
            "when": policy.describe().strip(),
            "group": policy.group,
            "required": policy.required,
            "ttl_seconds": policy.ttl_seconds,
            "on_expiry": str(policy.on_expiry),
        },
    }


class ToolReceiptSummarySerializer(serializers.Serializer):
    outcome = serializers.CharField()
    external_ref = serializers.CharField()
    source = serializers.CharField()
    recorded_by = serializers.CharField()
    created_at = serializers.DateTimeField()


class ToolCallSerializer(MaskedSerializerMixin, serializers.ModelSerializer):
    run = serializers.UUIDField(source="run_id")
    step_seq = serializers.IntegerField(source="step.seq")
    arguments = serializers.JSONField(
        source="arguments_masked",
        help_text="Sensitive fields are masked, and so is sensitive tool output copied into "
        "them (unless you may view it).",
    )
    receipt = serializers.SerializerMethodField()

    class Meta:
        model = ToolCall
        fields = [
            "id",
            "run",
            "step_seq",
            "tool_name",
            "tool_version",
            "effect",
            "arguments",
            "idempotency_key",
            "client_call_id",
            "status",
            "attempt_count",
            "dispatched_at",
            "send_deadline",
            "landing_deadline",
            "reconcile_attempts",
            "lookups_begun",
            "lookup_started_at",
            "last_error",
            "receipt",
            "created_at",
            "updated_at",
        ]
        read_only_fields = fields

    @extend_schema_field(ToolReceiptSummarySerializer(allow_null=True))
    def get_receipt(self, call: ToolCall) -> dict | None:
        receipt = getattr(call, "receipt", None)
        return ToolReceiptSummarySerializer(receipt).data if receipt is not None else None

    def to_representation(self, call: ToolCall) -> dict[str, Any]:
        data = super().to_representation(call)
        mask = self.mask_for(call.run_id)
        data["arguments"] = mask(data["arguments"])
        data["last_error"] = mask(data["last_error"])
        return data


class ToolCallListFilterSerializer(QueryParamsSerializer):
    status = serializers.ChoiceField(choices=ToolCall.Status.choices, required=False)
    run = serializers.UUIDField(required=False)


class TerminateInputSerializer(serializers.Serializer):
    reason = serializers.CharField(max_length=2000, help_text="Why; recorded in the run's events.")


class BudgetTopUpInputSerializer(serializers.Serializer):
    add_steps = serializers.IntegerField(min_value=0, max_value=1_000_000, default=0)
    add_cost = CostField(required=False)
    add_tokens = serializers.IntegerField(min_value=0, max_value=10**15, default=0)
    deadline = serializers.DateTimeField(
        required=False, allow_null=True, help_text="A new deadline (replaces the old one)."
    )


class ForkInputSerializer(serializers.Serializer):
    from_step = serializers.IntegerField(
        min_value=1, max_value=2**31 - 1, help_text="The last finished step to carry over."
    )
    agent_version = serializers.CharField(
        max_length=50, required=False, help_text="Defaults to the registered version."
    )
    as_me = serializers.BooleanField(
        required=False,
        default=False,
        help_text="The new run acts as the caller instead of the old run's principal "
        "(recorded in run.forked as principal {from, to}).",
    )


class ResolutionInputSerializer(serializers.Serializer):
    outcome = serializers.ChoiceField(
        choices=["happened", "not_happened", "dispatch_again", "reconcile"]
    )
    external_ref = StrictCharField(max_length=200, required=False, allow_blank=True, default="")
    result = serializers.JSONField(
        required=False, allow_null=True, default=None, help_text="For happened: the result."
    )
    confirm_risk = StrictBooleanField(
        default=False,
        help_text="Required to dispatch an unsafe tool again (it may repeat its effect).",
    )
    attestation = StrictCharField(
        max_length=2000,
        required=False,
        allow_blank=True,
        default="",
        help_text="For not_happened when no lookup that started after the landing deadline "
        "found the call absent: why you know it did not happen (recorded).",
    )

    def validate_result(self, value):
        _reject_null_characters(value)
        return value


class PauseInputSerializer(serializers.Serializer):
    reason = serializers.CharField(max_length=2000, required=False, allow_blank=True, default="")


# --- views ---------------------------------------------------------------------------------


class HealthApi(APIView):
    authentication_classes: list = []
    permission_classes = [AllowAny]
    throttle_classes: list = []

    @extend_schema(
        summary="Liveness and database check",
        auth=[],
        responses={
            200: inline_serializer(
                "Health", {"status": serializers.CharField(), "database": serializers.CharField()}
            ),
            503: inline_serializer(
                "HealthDown",
                {"status": serializers.CharField(), "database": serializers.CharField()},
            ),
        },
    )
    def get(self, request):
        try:
            with connection.cursor() as cursor:
                cursor.execute("SELECT 1")
        except Exception:  # any database failure means "not healthy"; nothing to carry on
            return Response(
                {"status": "error", "database": "unavailable"},
                status=status.HTTP_503_SERVICE_UNAVAILABLE,
            )
        return Response({"status": "ok", "database": "ok"})


def agent_data(agent: Agent) -> dict[str, Any]:
    """A hosted agent (tools from the registry) or a remote one (tools from its manifest,
    shown by the names the manifest gives them)."""
    if isinstance(agent, RemoteAgent):
        tools = [
            _tool_data(manifest_tool(agent.name, spec), name=spec["name"], remote=True)
            for spec in agent.tool_specs.values()
        ]
    else:
        tools = [_tool_data(registry.tool(name)) for name in agent.tools]
    return {
        "name": agent.name,
        "version": agent.version,
        "kind": "remote" if isinstance(agent, RemoteAgent) else "hosted",
        "description": agent.description,
        "input_schema": dict(agent.input_schema),
        "tools": tools,
    }


class AgentListApi(APIView):
    @extend_schema(
        summary="Registered agents with their tools",
        responses={200: AgentSerializer(many=True), **errors()},
    )
    def get(self, request):
        agents = [agent_data(agent) for agent in registry.agents()]
        agents += [agent_data(RemoteAgent(manifest)) for manifest in AgentManifest.objects.all()]
        agents.sort(key=lambda agent: agent["name"])
        return Response(AgentSerializer(agents, many=True).data)


def _run_detail(run_id: Any) -> Run:
    return selectors.run_get(run_id=run_id)


class RunCollectionApi(generics.GenericAPIView):
    """GET lists runs, POST starts one: two use cases sharing one URL."""

    pagination_class = CreatedCursorPagination

    def get_permissions(self):
        if self.request.method == "GET":
            return [CanReadRuns()]
        return super().get_permissions()

    @extend_schema(
        summary="List runs, newest first",
        parameters=[RunListFilterSerializer],
        responses={200: RunSummarySerializer(many=True), **errors("validation_error")},
    )
    def get(self, request):
        filters = RunListFilterSerializer(data=request.query_params)
        filters.is_valid(raise_exception=True)
        runs = readable(request, selectors.runs_for_api(**filters.validated_data))
        page = self.paginate_queryset(runs)
        return self.get_paginated_response(RunSummarySerializer(page, many=True).data)

    @extend_schema(
        summary="Start a run",
        parameters=[IDEMPOTENCY_KEY_HEADER],
        request=RunCreateInputSerializer,
        responses={
            201: RunSerializer,
            200: OpenApiResponse(RunSerializer, description="Replay of an Idempotency-Key."),
            **errors(
                "validation_error", "unknown_agent", "idempotency_key_reused", "dry_run_unsupported"
            ),
        },
    )
    def post(self, request):
        payload = RunCreateInputSerializer(data=request.data)
        payload.is_valid(raise_exception=True)
        data = payload.validated_data
        budget = data.get("budget") or {}
        kwargs = {
            "agent_name": data["agent"],
            "goal": data["goal"],
            "input": data["input"],
            "max_steps": budget.get("max_steps"),
            "max_cost": budget.get("max_cost"),
            "max_tokens": budget.get("max_tokens"),
            "deadline": budget.get("deadline"),
            "dry_run": data["dry_run"],
        }
        actor = actor_for(request)
        key = request.headers.get("Idempotency-Key")
        if key is None:
            run, created = services.run_create(actor=actor, **kwargs), True
        else:
            if not 1 <= len(key) <= 200 or not key.isprintable():
                raise ApiError(
                    "validation_error",
                    "invalid Idempotency-Key",
                    {"Idempotency-Key": ["1 to 200 printable characters"]},
                )
            run, created = run_create_idempotent(key=key, body=request.data, actor=actor, **kwargs)
        code = status.HTTP_201_CREATED if created else status.HTTP_200_OK
        return Response(
            RunSerializer(_run_detail(run.id), context={"request": request}).data, status=code
        )


# a run waiting for a person or an event: what a long poll of it waits to see end
PARKED = (
    Run.Status.WAITING_APPROVAL,
    Run.Status.WAITING_EVENT,
    Run.Status.NEEDS_ATTENTION,
    Run.Status.PAUSED,
)


def _require_readable(request, run_id: Any) -> None:
    # a run outside the reader's scope is not found: its existence is not theirs to learn
    if not readable(request, Run.objects.filter(id=run_id)).exists():
        raise ApiError("not_found", "Not found.")


class RunDetailApi(APIView):
    permission_classes = [CanReadRuns]

    @extend_schema(
        summary="One run with its state, budget and usage",
        description="`?wait=N` (at most 30): while the run is parked for a person or an event "
        "(waiting_approval, waiting_event, needs_attention, paused), the answer is held until "
        "its status changes or N seconds passed — e.g. a remote agent waiting for its "
        "approval or its wait to end, which then finds the run queued for it.",
        parameters=[longpoll.WaitQuerySerializer],
        responses={
            200: RunSerializer,
            **errors("validation_error", "not_found", "long_polls_busy"),
        },
    )
    def get(self, request, run_id):
        seconds = longpoll.wait_seconds(request)
        _require_readable(request, run_id)
        ended = longpoll.hold(
            request,
            lambda: Run.objects.filter(id=run_id).values_list("status", flat=True).first(),
            waiting=lambda status: status in PARKED,
            seconds=seconds,
        )
        response = Response(RunSerializer(_run_detail(run_id), context={"request": request}).data)
        response[longpoll.HEADER] = ended
        return response


class RunEventListApi(generics.GenericAPIView):
    permission_classes = [CanReadRuns]
    pagination_class = SeqPagination
    serializer_class = RunEventSerializer

    @extend_schema(
        summary="A run's events in order (resume with after_seq)",
        responses={
            200: RunEventSerializer(many=True),
            **errors("validation_error", "not_found"),
        },
    )
    def get(self, request, run_id):
        _require_readable(request, run_id)
        page = self.paginate_queryset(RunEvent.objects.filter(run_id=run_id))
        context = {"request": request}
        return self.get_paginated_response(
            RunEventSerializer(page, many=True, context=context).data
        )


class RunPauseApi(APIView):
    @extend_schema(
        summary="Pause a run (a running one pauses at its next checkpoint)",
        request=PauseInputSerializer,
        responses={200: RunSerializer, **errors("validation_error", "not_found", "invalid_state")},
    )
    def post(self, request, run_id):
        payload = PauseInputSerializer(data=request.data)
        payload.is_valid(raise_exception=True)
        run = services.run_pause(
            run_id=run_id, actor=actor_for(request), reason=payload.validated_data["reason"]
        )
        return Response(RunSerializer(_run_detail(run.id), context={"request": request}).data)


class RunResumeApi(APIView):
    @extend_schema(
        summary="Resume a paused run",
        request=None,
        responses={200: RunSerializer, **errors("not_found", "invalid_state")},
    )
    def post(self, request, run_id):
        run = services.run_resume(run_id=run_id, actor=actor_for(request))
        return Response(RunSerializer(_run_detail(run.id), context={"request": request}).data)


class RunTerminateApi(APIView):
    @extend_schema(
        summary="Terminate a run (a running one stops at its next checkpoint)",
        request=TerminateInputSerializer,
        responses={200: RunSerializer, **errors("validation_error", "not_found", "invalid_state")},
    )
    def post(self, request, run_id):
        payload = TerminateInputSerializer(data=request.data)
        payload.is_valid(raise_exception=True)
        run = services.run_terminate(
            run_id=run_id, actor=actor_for(request), reason=payload.validated_data["reason"]
        )
        return Response(RunSerializer(_run_detail(run.id), context={"request": request}).data)


class ToolCallListApi(generics.GenericAPIView):
    permission_classes = [CanReadToolCalls]
    pagination_class = IdCursorPagination

    @extend_schema(
        summary="Tool calls, newest first (status=unknown: outcomes waiting for a person)",
        parameters=[ToolCallListFilterSerializer],
        responses={200: ToolCallSerializer(many=True), **errors("validation_error")},
    )
    def get(self, request):
        filters = ToolCallListFilterSerializer(data=request.query_params)
        filters.is_valid(raise_exception=True)
        calls = readable(
            request,
            selectors.toolcalls_for_api(**filters.validated_data),
            "run__",
            "runs.view_toolcall",
        )
        page = self.paginate_queryset(calls)
        # the page's runs masked in one go (runs.masking)
        masks = maskers_for_ids({call.run_id for call in page}, user=request.user)
        context = {"request": request, "masks": masks}
        return self.get_paginated_response(
            ToolCallSerializer(page, many=True, context=context).data
        )


# --- operator actions of issue 3 (services in runs.services) --------------------------------


class RunBudgetApi(APIView):
    @extend_schema(
        summary="Top up a run's budget (a run stopped by its budget is queued again)",
        request=BudgetTopUpInputSerializer,
        responses={
            200: RunSerializer,
            **errors("validation_error", "not_found", "invalid_state", "budget_exhausted"),
        },
    )
    def post(self, request, run_id):
        payload = BudgetTopUpInputSerializer(data=request.data)
        payload.is_valid(raise_exception=True)
        run = services.run_topup_budget(
            run_id=run_id, actor=actor_for(request), **payload.validated_data
        )
        return Response(RunSerializer(_run_detail(run.id), context={"request": request}).data)


class RunForkApi(APIView):
    @extend_schema(
        summary="Fork a run from one of its finished steps onto the registered agent version",
        request=ForkInputSerializer,
        responses={
            201: OpenApiResponse(RunSerializer, description="The new run (the old one ends)."),
            **errors("validation_error", "not_found", "invalid_state"),
        },
    )
    def post(self, request, run_id):
        payload = ForkInputSerializer(data=request.data)
        payload.is_valid(raise_exception=True)
        fork = services.run_fork(run_id=run_id, actor=actor_for(request), **payload.validated_data)
        return Response(
            RunSerializer(_run_detail(fork.id), context={"request": request}).data,
            status=status.HTTP_201_CREATED,
        )


class RunPromoteApi(APIView):
    @extend_schema(
        summary="Start a finished dry run for real: a new run with the same input",
        description="None of the dry run's decisions is reused: the agent decides afresh, "
        "under new idempotency keys, and its approvals are asked again. The new run acts as "
        "the caller and names the dry run in promoted_from; a dry run is promoted once.",
        request=None,
        responses={
            201: OpenApiResponse(RunSerializer, description="The new, real run."),
            **errors("not_found", "invalid_state", "already_promoted", "unknown_agent"),
        },
    )
    def post(self, request, run_id):
        _require_readable(request, run_id)
        run = services.run_promote(run_id=run_id, actor=actor_for(request))
        return Response(
            RunSerializer(_run_detail(run.id), context={"request": request}).data,
            status=status.HTTP_201_CREATED,
        )


class RunRetryRecoveryApi(APIView):
    @extend_schema(
        summary="Give a run stopped at its recovery limit another go",
        request=None,
        responses={200: RunSerializer, **errors("not_found", "invalid_state")},
    )
    def post(self, request, run_id):
        run = services.run_retry_recovery(run_id=run_id, actor=actor_for(request))
        return Response(RunSerializer(_run_detail(run.id), context={"request": request}).data)


class ToolCallResolutionApi(APIView):
    @extend_schema(
        summary="Resolve a call whose outcome is unknown",
        request=ResolutionInputSerializer,
        responses={
            200: ToolCallSerializer,
            **errors(
                "validation_error", "not_found", "invalid_state", "unsafe_dispatch_unconfirmed"
            ),
        },
    )
    def post(self, request, tool_call_id):
        payload = ResolutionInputSerializer(data=request.data)
        payload.is_valid(raise_exception=True)
        services.toolcall_resolve(
            tool_call_id=tool_call_id, actor=actor_for(request), **payload.validated_data
        )
        call = selectors.toolcalls_for_api().get(id=tool_call_id)
        return Response(ToolCallSerializer(call, context={"request": request}).data)

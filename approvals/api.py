"""The approvals API: list, read and decide approvals through ``approval_decide``, the
service the pages and email links use."""

from __future__ import annotations

from django.db.models import Prefetch
from drf_spectacular.utils import extend_schema
from rest_framework import generics, serializers
from rest_framework.response import Response
from rest_framework.views import APIView

from approvals.models import Approval, ApprovalDecision
from approvals.services import approval_decide
from runs.api import MaskedSerializerMixin, _reject_null_characters, longpoll
from runs.api.common import (
    ApiError,
    IdCursorPagination,
    QueryParamsSerializer,
    actor_for,
    errors,
    has_perm,
)
from runs.masking import maskers_for_ids


class ApprovalDecisionSerializer(serializers.ModelSerializer):
    decider = serializers.CharField(source="decider.username")
    edited_arguments = serializers.JSONField(
        allow_null=True, help_text="Edit and approve: the arguments approved (masked)."
    )
    original_arguments = serializers.JSONField(
        allow_null=True, help_text="Edit and approve: the arguments as proposed (masked)."
    )

    class Meta:
        model = ApprovalDecision
        fields = [
            "decider",
            "decision",
            "channel",
            "comment",
            "edited_arguments",
            "original_arguments",
            "created_at",
        ]
        read_only_fields = fields


class ApprovalSerializer(MaskedSerializerMixin, serializers.ModelSerializer):
    arguments = serializers.JSONField(
        source="arguments_masked",
        help_text="Sensitive fields are masked, and so is sensitive tool output copied into "
        "them (unless you may view it).",
    )
    decisions = ApprovalDecisionSerializer(many=True)
    dry_run = serializers.BooleanField(
        source="run.dry_run",
        help_text="The approval belongs to a dry run: approving it sends nothing, and it is "
        "never used by a real dispatch.",
    )
    group_minimums = serializers.JSONField(
        help_text='Per-group minimums within required_count ({"finance": 1}: at least one '
        "approver from finance). Members of these groups may decide too."
    )
    policy_version = serializers.IntegerField(
        source="policy_version_id",
        allow_null=True,
        help_text="The data policy version that required it (null: the tool's code policy).",
    )

    class Meta:
        model = Approval
        fields = [
            "id",
            "run",
            "dry_run",
            "tool_call",
            "tool_name",
            "tool_version",
            "arguments",
            "arguments_digest",
            "status",
            "approver_group",
            "required_count",
            "group_minimums",
            "policy_version",
            "on_expiry",
            "requested_at",
            "expires_at",
            "decided_at",
            "consumed_at",
            "reason",
            "decisions",
        ]
        read_only_fields = fields

    def to_representation(self, approval: Approval) -> dict:
        data = super().to_representation(approval)
        mask = self.mask_for(approval.run_id)
        data["arguments"] = mask(data["arguments"])
        for decision in data["decisions"]:
            for name in ("edited_arguments", "original_arguments"):
                decision[name] = mask(decision[name])
        return data


class ApprovalListFilterSerializer(QueryParamsSerializer):
    status = serializers.ChoiceField(choices=Approval.Status.choices, required=False)
    run = serializers.UUIDField(required=False)


class ApprovalDecisionInputSerializer(serializers.Serializer):
    decision = serializers.ChoiceField(choices=["approve", "reject"])
    comment = serializers.CharField(required=False, allow_blank=True, default="", max_length=2000)
    arguments = serializers.DictField(
        required=False,
        help_text="Edit and approve: the arguments to dispatch instead (validated against the "
        'tool\'s schema; "***" in a sensitive field keeps the value you cannot see). The '
        "original is recorded beside the edit.",
    )

    def validate_arguments(self, value):
        _reject_null_characters(value)
        return value

    def validate(self, data):
        if "arguments" in data and data["decision"] != "approve":
            raise serializers.ValidationError({"arguments": ["only an approval can edit them"]})
        return data


def _approvals():
    decisions = ApprovalDecision.objects.select_related("decider")
    return Approval.objects.select_related("run").prefetch_related(
        Prefetch("decisions", queryset=decisions)
    )


class ApprovalListApi(generics.GenericAPIView):
    permission_classes = [has_perm("approvals.view_approval")]
    pagination_class = IdCursorPagination

    @extend_schema(
        summary="Approvals, newest first (status=pending: waiting for a decision)",
        parameters=[ApprovalListFilterSerializer],
        responses={200: ApprovalSerializer(many=True), **errors("validation_error")},
    )
    def get(self, request):
        filters = ApprovalListFilterSerializer(data=request.query_params)
        filters.is_valid(raise_exception=True)
        approvals = _approvals()
        if filters.validated_data.get("status"):
            approvals = approvals.filter(status=filters.validated_data["status"])
        if filters.validated_data.get("run"):
            approvals = approvals.filter(run_id=filters.validated_data["run"])
        page = self.paginate_queryset(approvals)
        assert page is not None  # pagination_class is set: every answer is a page
        # the page's runs masked in one go (runs.masking)
        masks = maskers_for_ids({approval.run_id for approval in page}, user=request.user)
        context = {"request": request, "masks": masks}
        return self.get_paginated_response(
            ApprovalSerializer(page, many=True, context=context).data
        )


class ApprovalDetailApi(APIView):
    permission_classes = [has_perm("approvals.view_approval")]

    @extend_schema(
        summary="One approval with its decisions",
        description="`?wait=N` (at most 30): while the approval is pending, the answer is held "
        "until its status changes or N seconds passed (runs.api.longpoll).",
        parameters=[longpoll.WaitQuerySerializer],
        responses={
            200: ApprovalSerializer,
            **errors("validation_error", "not_found", "long_polls_busy"),
        },
    )
    def get(self, request, approval_id):
        seconds = longpoll.wait_seconds(request)
        if not Approval.objects.filter(id=approval_id).exists():
            raise ApiError("not_found", "Not found.")
        ended = longpoll.hold(
            request,
            lambda: (
                Approval.objects.filter(id=approval_id).values_list("status", flat=True).first()
            ),
            waiting=lambda status: status == Approval.Status.PENDING,
            seconds=seconds,
        )
        approval = _approvals().get(id=approval_id)
        response = Response(ApprovalSerializer(approval, context={"request": request}).data)
        response[longpoll.HEADER] = ended
        return response


class ApprovalDecideApi(APIView):
    @extend_schema(
        summary="Approve or reject (each eligible person decides once)",
        request=ApprovalDecisionInputSerializer,
        responses={
            200: ApprovalSerializer,
            **errors("validation_error", "not_found", "already_decided", "approval_expired"),
        },
    )
    def post(self, request, approval_id):
        payload = ApprovalDecisionInputSerializer(data=request.data)
        payload.is_valid(raise_exception=True)
        approval_decide(
            approval_id=approval_id,
            decision=payload.validated_data["decision"],
            comment=payload.validated_data["comment"],
            edited_arguments=payload.validated_data.get("arguments"),
            actor=actor_for(request),
        )
        approval = _approvals().get(id=approval_id)
        return Response(ApprovalSerializer(approval, context={"request": request}).data)

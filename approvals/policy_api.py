"""The approval policy API (docs/api.md, "Approval policies"): list and read policies and
versions, draft a version, simulate a version or rules not yet drafted, publish, withdraw a
policy (a version published like any other) — through
``approvals.policy_services``, the functions the console uses. Domain errors are 4xx with a
code: ``validation_error`` (with ``fields`` by rule), ``invalid_state`` (not a draft, or
drafted against a version no longer current), ``permission_denied`` (not an admin, or the
drafter publishing)."""

from __future__ import annotations

from drf_spectacular.utils import extend_schema
from rest_framework import serializers
from rest_framework.response import Response
from rest_framework.views import APIView

from approvals.models import ApprovalPolicy, ApprovalPolicyVersion
from approvals.policy_services import (
    SIMULATE_MAX_DAYS,
    policy_rules_simulate,
    policy_simulate,
    policy_version_draft,
    policy_version_publish,
    policy_withdraw,
)
from runs.actors import PermissionDenied
from runs.api import _reject_null_characters
from runs.api.common import ApiError, actor_for, errors

VIEW = "approvals.view_approvalpolicy"


class TextField(serializers.CharField):
    """Text, and only text: DRF's CharField turns a number into a string, but a policy's
    note or tool named by a number is a client's mistake to report, not to guess."""

    def to_internal_value(self, data):
        if not isinstance(data, str):
            self.fail("invalid")
        return super().to_internal_value(data)


class PolicyVersionSerializer(serializers.ModelSerializer):
    policy = serializers.IntegerField(source="policy_id")
    tool = serializers.CharField(source="policy.tool_name")
    created_by = serializers.CharField(source="created_by.username")
    published_by = serializers.CharField(source="published_by.username", allow_null=True)
    based_on = serializers.IntegerField(source="based_on_id", allow_null=True)

    class Meta:
        model = ApprovalPolicyVersion
        fields = [
            "id",
            "policy",
            "tool",
            "number",
            "status",
            "rules",
            "time_zone",
            "note",
            "based_on",
            "created_by",
            "created_at",
            "published_by",
            "published_at",
            "simulated",
            "withdraws",
        ]
        read_only_fields = fields


class PolicySerializer(serializers.ModelSerializer):
    versions = PolicyVersionSerializer(many=True)

    class Meta:
        model = ApprovalPolicy
        fields = ["id", "tool_name", "agent_name", "principal_group", "created_at", "versions"]
        read_only_fields = fields


class DraftInputSerializer(serializers.Serializer):
    tool = TextField(max_length=100)
    agent = TextField(max_length=100, required=False, allow_blank=True, default="")
    principal_group = TextField(max_length=150, required=False, allow_blank=True, default="")
    rules = serializers.JSONField(help_text="Ordered rules (docs/approvals.md, 'Policies').")
    time_zone = TextField(max_length=64, required=False, default="UTC")
    note = TextField(max_length=2000, help_text="Why: recorded with the version.")
    based_on = serializers.IntegerField(
        required=False,
        allow_null=True,
        default=None,
        help_text="The published version this draft was written against: refused "
        "(invalid_state) if another was published since.",
    )

    def validate_rules(self, value):
        _reject_null_characters(value)
        return value

    def validate_note(self, value):
        _reject_null_characters(value)
        return value


class WithdrawInputSerializer(serializers.Serializer):
    note = TextField(max_length=2000, help_text="Why: recorded with the withdrawal.")
    based_on = serializers.IntegerField(
        required=False,
        allow_null=True,
        default=None,
        help_text="The published version you mean to withdraw: refused (invalid_state) if "
        "another was published since.",
    )

    def validate_note(self, value):
        _reject_null_characters(value)
        return value


class SimulateInputSerializer(serializers.Serializer):
    days = serializers.IntegerField(min_value=1, max_value=SIMULATE_MAX_DAYS, default=7)


class RulesSimulateInputSerializer(SimulateInputSerializer):
    tool = TextField(max_length=100)
    agent = TextField(max_length=100, required=False, allow_blank=True, default="")
    principal_group = TextField(max_length=150, required=False, allow_blank=True, default="")
    rules = serializers.JSONField()
    time_zone = TextField(max_length=64, required=False, default="UTC")

    def validate_rules(self, value):
        _reject_null_characters(value)
        return value


def _require_read(request) -> None:
    # checked in the handler, not as a permission class: OPTIONS describes the operation
    # to anyone signed in, like the other endpoints whose service checks the permission
    if not request.user.has_perm(VIEW):
        raise PermissionDenied("reading approval policies needs the admin or auditor role")


def _versions():
    return ApprovalPolicyVersion.objects.select_related(
        "policy", "created_by", "published_by"
    ).order_by("-number")


class PolicyListApi(APIView):
    @extend_schema(
        summary="Approval policies with their versions",
        responses={200: PolicySerializer(many=True), **errors()},
    )
    def get(self, request):
        from django.db.models import Prefetch

        _require_read(request)
        policies = ApprovalPolicy.objects.prefetch_related(
            Prefetch("versions", queryset=_versions())
        )
        return Response(PolicySerializer(policies, many=True).data)

    @extend_schema(
        summary="Draft a new version (the policy is created with its first)",
        request=DraftInputSerializer,
        responses={201: PolicyVersionSerializer, **errors("validation_error", "invalid_state")},
    )
    def post(self, request):
        payload = DraftInputSerializer(data=request.data)
        payload.is_valid(raise_exception=True)
        data = payload.validated_data
        version = policy_version_draft(
            actor=actor_for(request),
            tool_name=data["tool"],
            agent_name=data["agent"],
            principal_group=data["principal_group"],
            rules=data["rules"],
            time_zone=data["time_zone"],
            note=data["note"],
            based_on=data["based_on"],
        )
        return Response(PolicyVersionSerializer(_versions().get(id=version.id)).data, status=201)


class PolicyVersionDetailApi(APIView):
    @extend_schema(
        summary="One policy version",
        responses={200: PolicyVersionSerializer, **errors("not_found")},
    )
    def get(self, request, version_id):
        _require_read(request)
        version = _versions().filter(id=version_id).first()
        if version is None:
            raise ApiError("not_found", "Not found.")
        return Response(PolicyVersionSerializer(version).data)


class PolicyVersionSimulateApi(APIView):
    @extend_schema(
        summary="Replay the last N days of the tool's calls against this version",
        request=SimulateInputSerializer,
        responses={200: dict, **errors("validation_error", "not_found")},
    )
    def post(self, request, version_id):
        payload = SimulateInputSerializer(data=request.data)
        payload.is_valid(raise_exception=True)
        if not ApprovalPolicyVersion.objects.filter(id=version_id).exists():
            raise ApiError("not_found", "Not found.")
        simulation = policy_simulate(
            actor=actor_for(request), version_id=version_id, days=payload.validated_data["days"]
        )
        return Response(simulation.as_dict())


class PolicyVersionPublishApi(APIView):
    @extend_schema(
        summary="Publish a draft (not by the person who drafted it)",
        request=None,
        responses={200: dict, **errors("invalid_state", "not_found", "validation_error")},
    )
    def post(self, request, version_id):
        if not ApprovalPolicyVersion.objects.filter(id=version_id).exists():
            raise ApiError("not_found", "Not found.")
        version, done = policy_version_publish(
            actor=actor_for(request), version_id=version_id, request=request
        )
        return Response(
            {
                "version": PolicyVersionSerializer(_versions().get(id=version.id)).data,
                "approvals_requested_again": done.rerequested,
                "calls_denied": done.denied,
                "approvals_still_pending": done.still_pending,
            }
        )


class PolicyRulesSimulateApi(APIView):
    @extend_schema(
        summary="Simulate rules not yet drafted (nothing is written)",
        request=RulesSimulateInputSerializer,
        responses={200: dict, **errors("validation_error")},
    )
    def post(self, request):
        payload = RulesSimulateInputSerializer(data=request.data)
        payload.is_valid(raise_exception=True)
        data = payload.validated_data
        simulation = policy_rules_simulate(
            actor=actor_for(request),
            tool_name=data["tool"],
            rules=data["rules"],
            time_zone=data["time_zone"],
            agent_name=data["agent"],
            principal_group=data["principal_group"],
            days=data["days"],
        )
        return Response(simulation.as_dict())


class PolicyWithdrawApi(APIView):
    @extend_schema(
        summary="Draft the policy's withdrawal (published by another admin, like any version)",
        description="A version with no rules (``withdraws``: true). Once published, the "
        "policy is out of force: a broader data policy of the tool, or the tool's code "
        "policy, governs its calls again.",
        request=WithdrawInputSerializer,
        responses={
            201: PolicyVersionSerializer,
            **errors("validation_error", "invalid_state", "not_found"),
        },
    )
    def post(self, request, policy_id):
        payload = WithdrawInputSerializer(data=request.data)
        payload.is_valid(raise_exception=True)
        version = policy_withdraw(
            actor=actor_for(request),
            policy_id=policy_id,
            note=payload.validated_data["note"],
            based_on=payload.validated_data["based_on"],
        )
        return Response(PolicyVersionSerializer(_versions().get(id=version.id)).data, status=201)

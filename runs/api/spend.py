"""Spend caps through the API (docs/agents.md "Spend caps", docs/api.md): list every cap with
what its scope used, reserved and has left; set or remove a cap; top a scope up; settle a
model request a crash cut off — the same services as the console's page (``runs.spend``),
for operators; every change audited."""

from __future__ import annotations

from decimal import Decimal
from typing import Any

from drf_spectacular.utils import extend_schema
from rest_framework import serializers
from rest_framework.response import Response
from rest_framework.views import APIView

from runs import spend
from runs.api.common import ApiError, actor_for, errors, has_perm
from runs.api.limits import _Int, _Text
from runs.models import SpendCap, SpendReservation

_COST = {"max_digits": 12, "decimal_places": 6, "min_value": Decimal(0)}


class SpendCapInputSerializer(serializers.Serializer):
    scope = serializers.ChoiceField(choices=SpendCap.Scope.values)
    subject = _Text(
        max_length=200,
        required=False,
        allow_blank=True,
        default="",
        help_text="The agent's name (agent), the principal's username or * for each principal "
        "(principal, principal_day); empty for global_day.",
    )
    max_cost = serializers.DecimalField(
        required=False, allow_null=True, default=None, max_value=Decimal(999_999), **_COST
    )
    max_tokens = _Int(min_value=0, max_value=2**62, required=False, allow_null=True, default=None)
    reason = _Text(max_length=2000, required=False, allow_blank=True, default="")


class SpendCapRemoveSerializer(serializers.Serializer):
    scope = serializers.ChoiceField(choices=SpendCap.Scope.values)
    subject = _Text(max_length=200, required=False, allow_blank=True, default="")
    reason = _Text(max_length=2000, required=False, allow_blank=True, default="")


class SpendTopUpSerializer(serializers.Serializer):
    scope = serializers.ChoiceField(choices=SpendCap.Scope.values)
    subject = _Text(max_length=200, required=False, allow_blank=True, default="")
    add_cost = serializers.DecimalField(
        required=False, allow_null=True, default=None, max_value=Decimal(999_999), **_COST
    )
    add_tokens = _Int(min_value=0, max_value=2**62, required=False, allow_null=True, default=None)
    reason = _Text(max_length=2000, required=False, allow_blank=True, default="")


class SpendSettleSerializer(serializers.Serializer):
    cost = serializers.DecimalField(max_value=Decimal(999_999), **_COST)
    tokens = _Int(min_value=0, max_value=2**62)


class SpendScopeSerializer(serializers.Serializer):
    scope = serializers.CharField()
    subject = serializers.CharField(
        allow_blank=True, help_text="The agent, the principal's username, * or empty."
    )
    period = serializers.CharField(allow_blank=True, help_text="The day (day scopes), or empty.")
    cost_used = serializers.DecimalField(max_digits=14, decimal_places=6)
    cost_reserved = serializers.DecimalField(max_digits=14, decimal_places=6)
    max_cost = serializers.DecimalField(max_digits=14, decimal_places=6, allow_null=True)
    cost_left = serializers.DecimalField(max_digits=14, decimal_places=6, allow_null=True)
    tokens_used = serializers.IntegerField()
    tokens_reserved = serializers.IntegerField()
    max_tokens = serializers.IntegerField(allow_null=True)
    tokens_left = serializers.IntegerField(allow_null=True)
    runs_stopped = serializers.IntegerField(help_text="Runs this scope stopped (a top-up resumes).")
    set_by = serializers.CharField(allow_blank=True)
    reason = serializers.CharField(allow_blank=True)


class SpendTopUpResultSerializer(serializers.Serializer):
    scope = SpendScopeSerializer()
    resumed = serializers.IntegerField(help_text="Runs the top-up resumed.")


class SpendReservationSerializer(serializers.Serializer):
    id = serializers.IntegerField()
    run_id = serializers.UUIDField()
    kind = serializers.CharField()
    state = serializers.CharField()
    cost = serializers.DecimalField(max_digits=12, decimal_places=6)
    tokens = serializers.IntegerField()
    cost_settled = serializers.DecimalField(max_digits=12, decimal_places=6, allow_null=True)
    tokens_settled = serializers.IntegerField(allow_null=True)
    settled_by = serializers.CharField(allow_blank=True)


def _scope_data(view: spend.ScopeView) -> dict[str, Any]:
    return {
        "scope": view.scope,
        "subject": view.subject_label,
        "period": view.period,
        "cost_used": view.cost_used,
        "cost_reserved": view.cost_reserved,
        "max_cost": view.max_cost,
        "cost_left": view.cost_left,
        "tokens_used": view.tokens_used,
        "tokens_reserved": view.tokens_reserved,
        "max_tokens": view.max_tokens,
        "tokens_left": view.tokens_left,
        "runs_stopped": view.stopped,
        "set_by": view.cap.set_by,
        "reason": view.cap.reason,
    }


def _one(scope: str, subject_label: str) -> dict[str, Any] | None:
    for view in spend.scope_views():
        if view.scope == scope and view.subject_label == (subject_label or ""):
            return _scope_data(view)
    return None


class SpendCapListApi(APIView):
    permission_classes = [has_perm("runs.view_run")]

    @extend_schema(
        summary="Spend caps: each capped scope in its current period (used, reserved, cap, left)",
        responses={200: SpendScopeSerializer(many=True), **errors()},
    )
    def get(self, request):
        data = [_scope_data(view) for view in spend.scope_views()]
        return Response(SpendScopeSerializer(data, many=True).data)

    @extend_schema(
        summary="Set a spend cap (operators; audited): per agent, per principal, per "
        "principal per day, or everything per day",
        request=SpendCapInputSerializer,
        responses={
            200: SpendScopeSerializer(many=True),
            **errors("validation_error", "not_found"),
        },
    )
    def post(self, request):
        payload = SpendCapInputSerializer(data=request.data)
        payload.is_valid(raise_exception=True)
        row = spend.spend_cap_set(
            actor=actor_for(request), request=request, **payload.validated_data
        )
        views = [v for v in spend.scope_views() if v.cap.pk == row.pk]
        return Response(SpendScopeSerializer([_scope_data(v) for v in views], many=True).data)


class SpendCapRemoveApi(APIView):
    @extend_schema(
        summary="Remove a spend cap (operators; audited): the runs it stopped resume",
        request=SpendCapRemoveSerializer,
        responses={204: None, **errors("validation_error", "not_found")},
    )
    def post(self, request):
        payload = SpendCapRemoveSerializer(data=request.data)
        payload.is_valid(raise_exception=True)
        if not spend.spend_cap_remove(
            actor=actor_for(request), request=request, **payload.validated_data
        ):
            raise ApiError("not_found", "There is no such cap.")
        return Response(status=204)


class SpendTopUpApi(APIView):
    @extend_schema(
        summary="Top up a capped scope for its current period (operators; audited): every run "
        "it stopped resumes",
        request=SpendTopUpSerializer,
        responses={
            200: SpendTopUpResultSerializer,
            **errors("validation_error", "not_found", "budget_exhausted"),
        },
    )
    def post(self, request):
        payload = SpendTopUpSerializer(data=request.data)
        payload.is_valid(raise_exception=True)
        done = spend.spend_top_up(
            actor=actor_for(request), request=request, **payload.validated_data
        )
        scope = _one(done.counter.scope, payload.validated_data["subject"].strip())
        return Response(SpendTopUpResultSerializer({"scope": scope, "resumed": done.resumed}).data)


class SpendReservationListApi(APIView):
    permission_classes = [has_perm("runs.view_run")]

    @extend_schema(
        summary="Model requests a crash cut off, charged at their maximum until settled",
        responses={200: SpendReservationSerializer(many=True), **errors()},
    )
    def get(self, request):
        rows = spend.cut_off_reservations()
        return Response(SpendReservationSerializer(rows, many=True).data)


class SpendReservationSettleApi(APIView):
    @extend_schema(
        summary="Settle a cut-off model request with its real usage (operators; recorded in "
        "the run as spend.settled)",
        request=SpendSettleSerializer,
        responses={
            200: SpendReservationSerializer,
            **errors("validation_error", "not_found", "invalid_state"),
        },
    )
    def post(self, request, reservation_id: int):
        payload = SpendSettleSerializer(data=request.data)
        payload.is_valid(raise_exception=True)
        row = spend.spend_reservation_settle(
            reservation_id=reservation_id,
            cost=payload.validated_data["cost"],
            tokens=payload.validated_data["tokens"],
            actor=actor_for(request),
            request=request,
        )
        return Response(SpendReservationSerializer(SpendReservation.objects.get(pk=row.pk)).data)

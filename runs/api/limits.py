"""Tool limits through the API (docs/agents.md "Limits"): list them with what they hold now,
set one, remove one — the same services as the console's page (``runs.flow``), for
operators; every change audited."""

from __future__ import annotations

from typing import Any

from drf_spectacular.utils import extend_schema
from rest_framework import serializers
from rest_framework.response import Response
from rest_framework.views import APIView

from runs import flow
from runs.api.common import ApiError, actor_for, errors, has_perm


# JSON types as the schema says them: "2" is not a number here, 0 is not a reason (a limit
# set by a typo's coercion would throttle a downstream nobody meant to)
class _Text(serializers.CharField):
    def to_internal_value(self, data):
        if not isinstance(data, str):
            self.fail("invalid")
        return super().to_internal_value(data)


class _Int(serializers.IntegerField):
    def to_internal_value(self, data):
        if isinstance(data, bool) or not isinstance(data, int):
            self.fail("invalid")
        return super().to_internal_value(data)


class _Number(serializers.FloatField):
    def to_internal_value(self, data):
        if isinstance(data, bool) or not isinstance(data, int | float):
            self.fail("invalid")
        return super().to_internal_value(data)


class ToolLimitInputSerializer(serializers.Serializer):
    tool_name = _Text(max_length=200)
    max_in_flight = _Int(
        min_value=1, max_value=100_000, required=False, allow_null=True, default=None
    )
    rate = _Number(
        min_value=0.001, max_value=1_000_000, required=False, allow_null=True, default=None
    )
    per_seconds = serializers.ChoiceField(
        choices=[1, 60], required=False, default=1, help_text="1: per second; 60: per minute."
    )
    burst = _Int(min_value=1, max_value=100_000, required=False, allow_null=True, default=None)
    key_argument = _Text(
        max_length=100,
        required=False,
        allow_blank=True,
        default="",
        help_text="One limit per value of this argument (e.g. a merchant account).",
    )
    reason = _Text(max_length=2000, required=False, allow_blank=True, default="")


class ToolLimitRemoveSerializer(serializers.Serializer):
    tool_name = _Text(max_length=200)
    reason = _Text(max_length=2000, required=False, allow_blank=True, default="")


class LimitSerializer(serializers.Serializer):
    max_in_flight = serializers.IntegerField(allow_null=True)
    rate = serializers.FloatField(allow_null=True)
    per_seconds = serializers.FloatField()
    burst = serializers.IntegerField(allow_null=True)
    key_argument = serializers.CharField()


class ToolLimitSerializer(serializers.Serializer):
    tool_name = serializers.CharField()
    declared = LimitSerializer(allow_null=True, help_text="What the tool declares in code.")
    effective = LimitSerializer(allow_null=True, help_text="What applies now.")
    set_by_operator = serializers.BooleanField()
    set_by = serializers.CharField(allow_blank=True)
    reason = serializers.CharField(allow_blank=True)
    in_flight = serializers.IntegerField(help_text="Calls holding a slot now.")
    waiting = serializers.IntegerField(help_text="Runs waiting for capacity.")


def _view_data(view: flow.LimitView) -> dict[str, Any]:
    return {
        "tool_name": view.tool_name,
        "declared": view.declared,
        "effective": view.effective,
        "set_by_operator": view.operator is not None,
        "set_by": view.operator.set_by if view.operator else "",
        "reason": view.operator.reason if view.operator else "",
        "in_flight": view.in_flight,
        "waiting": view.waiting,
    }


def _one(tool_name: str) -> dict[str, Any]:
    for view in flow.limit_views():
        if view.tool_name == tool_name:
            return _view_data(view)
    return {"tool_name": tool_name, "declared": None, "effective": None, "set_by_operator": False,
            "set_by": "", "reason": "", "in_flight": 0, "waiting": 0}  # fmt: skip


class ToolLimitListApi(APIView):
    permission_classes = [has_perm("runs.view_run")]

    @extend_schema(
        summary="Tool limits: what each tool may use of its downstream, and what it uses now",
        responses={200: ToolLimitSerializer(many=True), **errors()},
    )
    def get(self, request):
        data = [_view_data(view) for view in flow.limit_views()]
        return Response(ToolLimitSerializer(data, many=True).data)

    @extend_schema(
        summary="Set a tool's limit (operators; replaces the tool's declared limit — with "
        "neither a maximum in flight nor a rate, lifts it; audited)",
        request=ToolLimitInputSerializer,
        responses={200: ToolLimitSerializer, **errors("validation_error", "not_found")},
    )
    def post(self, request):
        payload = ToolLimitInputSerializer(data=request.data)
        payload.is_valid(raise_exception=True)
        values = dict(payload.validated_data)
        values["per_seconds"] = float(values["per_seconds"])
        row = flow.tool_limit_set(actor=actor_for(request), request=request, **values)
        return Response(ToolLimitSerializer(_one(row.tool_name)).data)


class ToolLimitRemoveApi(APIView):
    @extend_schema(
        summary="Remove an operator's limit on a tool (its declared limit applies again)",
        request=ToolLimitRemoveSerializer,
        responses={200: ToolLimitSerializer, **errors("validation_error", "not_found")},
    )
    def post(self, request):
        payload = ToolLimitRemoveSerializer(data=request.data)
        payload.is_valid(raise_exception=True)
        removed = flow.tool_limit_remove(actor=actor_for(request), request=request, **payload.data)
        if not removed:
            raise ApiError("not_found", "This tool has no operator's limit.")
        return Response(ToolLimitSerializer(_one(payload.data["tool_name"])).data)

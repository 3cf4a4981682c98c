"""The lease: claim a remote run (with its resume packet), heartbeat, release."""

from __future__ import annotations

from collections.abc import Callable

from drf_spectacular.utils import extend_schema
from rest_framework import serializers
from rest_framework.response import Response
from rest_framework.views import APIView

from runs import remote
from runs.api.common import actor_for, errors
from runs.api.remote.common import DRY_RUN_HELP, FenceSerializer, lease_proof, request_data
from runs.api.remote.resume import ResumeSerializer
from runs.models import Run


class LeaseInputSerializer(serializers.Serializer):
    owner = serializers.CharField(
        max_length=100,
        required=False,
        allow_blank=True,
        default="",
        help_text="A name for this process (host, pid): shown as the lease owner.",
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
        data = request_data(LeaseInputSerializer, request)
        grant = remote.remote_lease_acquire(
            run_id=run_id, actor=actor_for(request), owner=data["owner"]
        )
        return Response(LeaseSerializer(grant).data)


# heartbeat and release: the holder's proof in, the lease as it now stands out
LEASE_STATUS_RESPONSES = {
    200: LeaseStatusSerializer,
    **errors("validation_error", "not_found", "invalid_state", "lease_lost", "lease_not_yours"),
}


def lease_status_response(service: Callable[..., Run], request, run_id) -> Response:
    data = request_data(FenceSerializer, request)
    run = service(run_id=run_id, **lease_proof(data), actor=actor_for(request))
    return Response(LeaseStatusSerializer(run).data)


class LeaseHeartbeatApi(APIView):
    @extend_schema(
        summary="Extend the lease (send well within its time to live)",
        request=FenceSerializer,
        responses=LEASE_STATUS_RESPONSES,
    )
    def post(self, request, run_id):
        return lease_status_response(remote.remote_lease_heartbeat, request, run_id)


class LeaseReleaseApi(APIView):
    @extend_schema(
        summary="Give the lease back (the run waits for an agent process)",
        request=FenceSerializer,
        responses=LEASE_STATUS_RESPONSES,
    )
    def post(self, request, run_id):
        return lease_status_response(remote.remote_lease_release, request, run_id)

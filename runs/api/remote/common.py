"""What the remote-agent protocol's endpoints share: the holder's proof (``fence`` and
``lease_token``, in every write's body), the protocol's limits and help texts, and reading a
request's body."""

from __future__ import annotations

from typing import Any

from rest_framework import serializers, status
from rest_framework.response import Response

from runs.api import _reject_null_characters

FENCE_HELP = "The fence returned by POST /lease/: proves this process still holds the lease."
LEASE_TOKEN_HELP = (
    "The lease_token returned by POST /lease/ with this fence: proves this process is the one "
    "the claim answered (the fence alone is visible to every viewer of the run)."
)
MAX_FENCE = 2**63 - 1
MAX_SEQ = 2**31 - 1

SEQ_HELP = (
    "Optional: the step number this request should get (the last step's seq + 1). A retry "
    "with the same seq by the same fence gets the step its first attempt recorded (200) "
    "instead of a second one; any other seq than the next is invalid_state."
)


DRY_RUN_HELP = (
    "A dry run: call no tool that is not read. For each such call, dispatch it as usual, "
    "do NOT execute it, and report what it would do as its receipt (recorded as simulated). "
    "The guarantee rests on this process: the server cannot stop it from calling a tool."
)


def json_value(value: Any) -> Any:
    _reject_null_characters(value)
    return value


def request_data(serializer: type[serializers.Serializer], request) -> dict[str, Any]:
    """The request's body, validated by ``serializer`` (else ``validation_error``)."""
    payload = serializer(data=request.data)
    payload.is_valid(raise_exception=True)
    return payload.validated_data


def recorded_response(body: Any, *, replayed: bool) -> Response:
    """201 for what this request recorded; 200 for a retry answered with what its first
    attempt recorded (a step, a proposal, a wait, an append to the history)."""
    return Response(body, status=status.HTTP_200_OK if replayed else status.HTTP_201_CREATED)


class FenceSerializer(serializers.Serializer):
    fence = serializers.IntegerField(min_value=1, max_value=MAX_FENCE, help_text=FENCE_HELP)
    lease_token = serializers.CharField(
        min_length=1, max_length=200, trim_whitespace=False, help_text=LEASE_TOKEN_HELP
    )


def lease_proof(data: dict[str, Any]) -> dict[str, Any]:
    """The holder's proof, as every fenced service takes it."""
    return {"fence": data["fence"], "lease_token": data["lease_token"]}

"""The resume packet: what a lease's claim answers about the run (its state, finished steps,
open calls, unknown outcomes, approvals, version hops) so an agent process can go on."""

from __future__ import annotations

from rest_framework import serializers

from runs.api.remote.common import DRY_RUN_HELP
from runs.api.remote.waits import WaitOutcomeSerializer
from runs.models import ToolCall


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

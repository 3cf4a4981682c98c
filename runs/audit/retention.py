"""Retention of the record (docs/audit.md, docs/operations.md)."""

from __future__ import annotations

import json
from datetime import timedelta
from typing import Any

from django.db.models import QuerySet

from runs.models import Run, RunEvent
from runs.record.eventtypes import EventType

# ``python manage.py prune`` empties the bulky, possibly personal data of terminal runs past
# the retention period: step input/output, tool-call arguments, receipt results, run state.
# Every event (with its masked payload) and every digest is kept, so the chains still verify,
# and a ``run.pruned`` event records what was emptied, by whom, and where it was archived.

PRUNED_EVENT = EventType.RUN_PRUNED


def prune_candidates(older_than: timedelta) -> QuerySet:
    """Terminal runs that finished more than ``older_than`` ago (database time) and were not
    pruned yet, oldest first."""
    from django.db.models import DateTimeField, Exists, ExpressionWrapper, OuterRef
    from django.db.models.functions import Coalesce, Now

    cutoff = ExpressionWrapper(Now() - older_than, output_field=DateTimeField())
    pruned = RunEvent.objects.filter(run_id=OuterRef("pk"), type=PRUNED_EVENT)
    return (
        Run.objects.filter(status__in=Run.TERMINAL)
        .annotate(ended_at=Coalesce("finished_at", "updated_at"))
        .filter(ended_at__lt=cutoff)
        .exclude(Exists(pruned))
    )


def prune_counts(run_ids: list[Any]) -> dict[str, int]:
    from runs.models import Step, ToolCall, ToolReceipt

    return {
        "runs": len(run_ids),
        "steps": Step.objects.filter(run_id__in=run_ids).count(),
        "tool_calls": ToolCall.objects.filter(run_id__in=run_ids).count(),
        "receipts": ToolReceipt.objects.filter(tool_call__run_id__in=run_ids).count(),
    }


def run_archive_record(run_id: Any) -> dict[str, Any]:
    """Everything prune is about to empty for one run, as one JSON object: the run's state,
    its steps' input/output, its calls' real (unmasked) arguments and its receipts' results.
    The archive therefore holds sensitive values: keep it like a database backup."""
    from runs.models import Step, ToolCall, ToolReceipt

    run = Run.objects.values(
        "id", "agent_name", "agent_version", "status", "reason_code", "state", "state_version"
    ).get(id=run_id)
    steps = Step.objects.filter(run_id=run_id).order_by("seq")
    calls = ToolCall.objects.filter(run_id=run_id).order_by("step__seq")
    receipts = ToolReceipt.objects.filter(tool_call__run_id=run_id).order_by("tool_call__step__seq")
    record = {
        "format": "agentops-prune-archive/1",
        "run": run,
        "steps": list(steps.values("seq", "kind", "status", "input", "output")),
        "tool_calls": list(
            calls.values("idempotency_key", "tool_name", "arguments", "arguments_digest")
        ),
        "receipts": list(
            receipts.values("tool_call__idempotency_key", "outcome", "external_ref", "result")
        ),
    }
    return json.loads(json.dumps(record, default=str))


def run_prune(
    *, run_id: Any, actor: Any, older_than: str, archive: str = "", archive_digest: str = ""
) -> dict[str, int] | None:
    """Empty one terminal run's bulky data and append ``run.pruned``, in one transaction with
    the run row locked. Returns what was emptied, or None when the run was pruned meanwhile
    (another prune) — then nothing is written."""
    from runs.models import Step, ToolCall, ToolReceipt
    from runs.record.checkpoint import checkpoint

    with checkpoint(run_id, actor=actor.label, channel=actor.channel) as cp:
        if cp.run.status not in Run.TERMINAL:
            raise ValueError(f"run {run_id} is {cp.run.status}, not terminal: not pruned")
        if RunEvent.objects.filter(run_id=run_id, type=PRUNED_EVENT).exists():
            return None
        counts = {
            "steps": Step.objects.filter(run_id=run_id).update(input={}, output=None),
            "tool_calls": ToolCall.objects.filter(run_id=run_id).update(arguments={}),
            "receipts": ToolReceipt.objects.filter(tool_call__run_id=run_id).update(result=None),
        }
        cp.update(state={})
        cp.event(
            PRUNED_EVENT,
            by=actor.label,
            older_than=older_than,
            emptied=[
                "run.state",
                "step.input",
                "step.output",
                "toolcall.arguments",
                "receipt.result",
            ],
            archive=archive or None,
            archive_digest=archive_digest or None,
            **counts,
        )
    return counts

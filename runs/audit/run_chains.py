"""Verifying the run event chains (docs/audit.md).

**Run events** (``RunEvent``) are written by ``runs.record.checkpoint.checkpoint`` only. Verification
proves every stored event still hashes to its stored hash over its own fields and its payload
digest, each links to the event before it (the first to the run's id), sequence numbers have
no gap, and the run's recorded head (``event_seq``, ``last_event_hash``) matches the last
event. So an edited, deleted, inserted or reordered event is detected.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from runs.models import Run, RunEvent
from runs.record.chain import anchor_hash, event_hash, payload_digest


@dataclass(frozen=True)
class BrokenLink:
    run_id: Any
    seq: int
    problem: str

    def __str__(self) -> str:
        return f"run {self.run_id} event {self.seq}: {self.problem}"


def verify_run(run: Run) -> BrokenLink | None:
    """The first broken link of one run's chain, or None when it is intact.

    ``prune`` empties steps, tool calls, receipts and run state but never an event: events keep
    their payloads, so every payload digest is recomputed here, pruned run or not."""
    previous = anchor_hash(run.id)
    expected_seq = 0
    events = RunEvent.objects.filter(run_id=run.id).order_by("seq").iterator(chunk_size=2000)
    for event in events:
        expected_seq += 1
        if event.seq != expected_seq:
            return BrokenLink(run.id, expected_seq, f"missing (next stored event is {event.seq})")
        if event.prev_hash != previous:
            return BrokenLink(run.id, event.seq, "does not link to the event before it")
        if event.payload_digest != payload_digest(event.payload):
            return BrokenLink(run.id, event.seq, "payload does not match its digest")
        if event.hash != event_hash(event):
            return BrokenLink(run.id, event.seq, "fields do not match the event's hash")
        previous = event.hash
    if run.event_seq != expected_seq:
        return BrokenLink(
            run.id, expected_seq + 1, f"run records {run.event_seq} events, {expected_seq} stored"
        )
    if expected_seq and run.last_event_hash != previous:
        return BrokenLink(run.id, expected_seq, "run's head hash does not match the last event")
    return None


def verify_all(run_ids: list[Any] | None = None) -> Iterator[tuple[Run, BrokenLink | None]]:
    runs = Run.objects.order_by("created_at", "id").only("id", "event_seq", "last_event_hash")
    if run_ids is not None:
        runs = runs.filter(id__in=run_ids)
    for run in runs.iterator(chunk_size=500):
        yield run, verify_run(run)

"""Verifying the run event chains (docs/audit.md).

**Run events** (``RunEvent``) are written by ``runs.record.checkpoint.checkpoint`` only. Verification
proves every stored event still hashes to its stored hash over its own fields and its payload
digest, each links to the event before it (the first to the run's id), sequence numbers have
no gap, and the run's recorded head (``event_seq``, ``last_event_hash``) matches the last
event. So an edited, deleted, inserted or reordered event is detected.

**Incremental** (the default of ``audit_verify``): a run's chain verified up to an event is
recorded (``VerifiedChain``: its seq and hash); the next check reads only the events after
it, after checking that event is still there with its hash, and a run whose head is the
recorded one is not read at all. An event before that point rewritten since (which takes the
tables' owner: the append-only trigger refuses everyone else) is found only by ``--full``.

**Archived runs** (``ArchivedChain``, ``retention``): events up to a head were exported and
possibly dropped from the table; a dropped run's stored chain starts after that head and must
link to it, and the run's head must be where the export ended when nothing came after.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from django.db.models import Exists, OuterRef, QuerySet
from django.utils import timezone

from runs.models import ArchivedChain, Run, RunEvent, VerifiedChain
from runs.record.chain import anchor_hash, event_hash, payload_digest

CHUNK = 500


@dataclass(frozen=True)
class BrokenLink:
    run_id: Any
    seq: int
    problem: str

    def __str__(self) -> str:
        return f"run {self.run_id} event {self.seq}: {self.problem}"


@dataclass(frozen=True)
class ChainPoint:
    """An event of a run's chain known from elsewhere: its seq and hash."""

    seq: int
    hash: str


def verify_run(
    run: Run,
    *,
    verified: ChainPoint | None = None,
    archived: ChainPoint | None = None,
    dropped: bool = False,
) -> BrokenLink | None:
    """The first broken link of one run's chain, or None when it is intact (then the run's
    recorded head, ``event_seq`` and ``last_event_hash``, is the chain's verified head).

    ``verified``: start after this point, verified earlier (incremental); the event there must
    still be stored with that hash. ``archived``: the head ``retention`` exported up to; with
    ``dropped`` the events up to it are gone and the stored ones must link to it, otherwise
    the stored event there must be the exported head.

    ``prune`` empties steps, tool calls, receipts and run state but never an event: events keep
    their payloads, so every payload digest is recomputed here, pruned run or not."""
    start = ChainPoint(0, anchor_hash(run.id))
    if archived is not None and dropped:
        start = archived
    incremental = verified is not None and verified.seq > start.seq
    if incremental:
        start = verified
    previous, expected_seq = start.hash, start.seq
    events = RunEvent.objects.filter(run_id=run.id).order_by("seq")
    if incremental:
        events = events.filter(seq__gte=start.seq)
    elif start.seq:
        events = events.filter(seq__gt=start.seq)
    found_start = not incremental
    for event in events.iterator(chunk_size=2000):
        if not found_start:
            if event.seq != start.seq:
                return BrokenLink(run.id, start.seq, "gone since audit_verify verified it")
            if event.hash != start.hash:
                return BrokenLink(run.id, start.seq, "changed since audit_verify verified it")
            found_start = True
            continue
        expected_seq += 1
        if event.seq != expected_seq:
            return BrokenLink(run.id, expected_seq, f"missing (next stored event is {event.seq})")
        if event.prev_hash != previous:
            return BrokenLink(run.id, event.seq, "does not link to the event before it")
        if event.payload_digest != payload_digest(event.payload):
            return BrokenLink(run.id, event.seq, "payload does not match its digest")
        if event.hash != event_hash(event):
            return BrokenLink(run.id, event.seq, "fields do not match the event's hash")
        if archived is not None and event.seq == archived.seq and event.hash != archived.hash:
            return BrokenLink(run.id, event.seq, "is not the head its export recorded")
        previous = event.hash
    if not found_start:
        return BrokenLink(run.id, start.seq, "gone since audit_verify verified it")
    if run.event_seq != expected_seq:
        return BrokenLink(
            run.id, expected_seq + 1, f"run records {run.event_seq} events, {expected_seq} stored"
        )
    if expected_seq and run.last_event_hash != previous:
        return BrokenLink(run.id, expected_seq, "run's head hash does not match the last event")
    return None


def runs_to_verify(run_ids: list[Any] | None = None, *, full: bool = False) -> QuerySet:
    """The runs a check reads, oldest first: all of them with ``full``; otherwise those whose
    head is not the one verified last time (new events since, or never verified)."""
    runs = Run.objects.order_by("created_at", "id").only("id", "event_seq", "last_event_hash")
    if run_ids is not None:
        runs = runs.filter(id__in=run_ids)
    if not full:
        unchanged = VerifiedChain.objects.filter(
            run_id=OuterRef("pk"), seq=OuterRef("event_seq"), hash=OuterRef("last_event_hash")
        )
        runs = runs.exclude(Exists(unchanged))
    return runs


def verify_all(
    run_ids: list[Any] | None = None, *, full: bool = True, record: bool = False
) -> Iterator[tuple[Run, BrokenLink | None]]:
    """Each run ``runs_to_verify`` selects with its first broken link (None: intact). With
    ``record``, the heads of the intact ones are recorded (``VerifiedChain``) a chunk of runs
    at a time, for the next incremental check; a run found broken records nothing."""
    chunk: list[Run] = []
    for run in runs_to_verify(run_ids, full=full).iterator(chunk_size=CHUNK):
        chunk.append(run)
        if len(chunk) == CHUNK:
            yield from _verify_chunk(chunk, full=full, record=record)
            chunk = []
    if chunk:
        yield from _verify_chunk(chunk, full=full, record=record)


def _verify_chunk(
    runs: list[Run], *, full: bool, record: bool
) -> Iterator[tuple[Run, BrokenLink | None]]:
    ids = [run.id for run in runs]
    verified = {}
    if not full:
        verified = {
            mark.run_id: ChainPoint(mark.seq, mark.hash)
            for mark in VerifiedChain.objects.filter(run_id__in=ids)
        }
    archived = {mark.run_id: mark for mark in ArchivedChain.objects.filter(run_id__in=ids)}
    heads = []
    for run in runs:
        mark = archived.get(run.id)
        broken = verify_run(
            run,
            verified=verified.get(run.id),
            archived=ChainPoint(mark.seq, mark.hash) if mark else None,
            dropped=bool(mark and mark.dropped_at),
        )
        yield run, broken
        if broken is None and run.event_seq:
            heads.append(
                VerifiedChain(
                    run_id=run.id,
                    seq=run.event_seq,
                    hash=run.last_event_hash,
                    verified_at=timezone.now(),
                )
            )
    if record and heads:
        VerifiedChain.objects.bulk_create(
            heads,
            update_conflicts=True,
            unique_fields=["run"],
            update_fields=["seq", "hash", "verified_at"],
        )


def verified_head_gone(run_ids: list[Any] | None = None) -> BrokenLink | None:
    """The first run whose verified head (``VerifiedChain``) is no longer stored with its hash,
    or None. One set-based query (an index probe per verified run, no event read into Python):
    what lets an incremental check notice an emptied, rewound or rewritten-at-the-end events
    table whose run rows were left alone. Runs whose events ``retention`` dropped up to that
    head are not expected to have it."""
    stored = RunEvent.objects.filter(
        run_id=OuterRef("run_id"), seq=OuterRef("seq"), hash=OuterRef("hash")
    )
    dropped = ArchivedChain.objects.filter(
        run_id=OuterRef("run_id"), seq__gte=OuterRef("seq"), dropped_at__isnull=False
    )
    gone = VerifiedChain.objects.exclude(Exists(stored)).exclude(Exists(dropped))
    if run_ids is not None:
        gone = gone.filter(run_id__in=run_ids)
    first = gone.order_by("run_id").values_list("run_id", "seq").first()
    if first is None:
        return None
    return BrokenLink(first[0], first[1], "gone or changed since audit_verify verified it")

"""Fault injection (contract, DESIGN §4).

With ``AGENTOPS_CRASH_AT=<boundary>[:<n>]`` set, the worker SIGKILLs its whole ``runworker``
process group right after the commit that contains the n-th occurrence of that boundary in
that worker (default n=1) -- counted across all its cluster processes, which ``runworker``
arranges with ``share_counts()`` before it forks them. Inert when unset.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import sys
import threading
from dataclasses import dataclass

BOUNDARIES = (
    "claimed",
    "decided",
    "approval_requested",
    "dispatching",
    "tool_call",
    "receipt_recorded",
    "step_completed",
    "run_finished",
)


class BadCrashSpec(ValueError):
    pass


@dataclass(frozen=True)
class CrashSpec:
    boundary: str
    occurrence: int = 1


def parse_crash_spec(value: str | None) -> CrashSpec | None:
    if value is None or value.strip() == "":
        return None
    boundary, _, count = value.strip().partition(":")
    if boundary not in BOUNDARIES:
        raise BadCrashSpec(
            f"AGENTOPS_CRASH_AT={value!r}: unknown boundary {boundary!r} "
            f"(expected one of {', '.join(BOUNDARIES)}, optionally followed by :N)"
        )
    if count == "":
        return CrashSpec(boundary)
    if not count.isdigit() or int(count) < 1:
        raise BadCrashSpec(
            f"AGENTOPS_CRASH_AT={value!r}: the occurrence must be a positive integer"
        )
    return CrashSpec(boundary, int(count))


_lock = threading.Lock()
_seen: dict[str, int] = {}
_spec: CrashSpec | None = None
_loaded = False
# one counter for the whole process group, inherited by the processes forked after it exists
_shared_count = None


def _current_spec() -> CrashSpec | None:
    global _spec, _loaded
    if not _loaded:
        # a malformed value is rejected by runworker at start; here it is simply inert
        try:
            _spec = parse_crash_spec(os.environ.get("AGENTOPS_CRASH_AT"))
        except BadCrashSpec:
            _spec = None
        _loaded = True
    return _spec


def reset() -> None:
    """Forget the parsed spec and counts (tests change the environment)."""
    global _loaded, _shared_count
    with _lock:
        _seen.clear()
        _loaded = False
        _shared_count = None


def share_counts() -> None:
    """Count occurrences across every process forked from this one from now on (the
    django-q2 cluster runs tasks in several processes; ``:n`` means the worker's n-th)."""
    global _shared_count
    if _current_spec() is not None:
        _shared_count = multiprocessing.get_context("fork").Value("i", 0)


def _count(boundary: str) -> int:
    shared = _shared_count
    if shared is not None:
        with shared.get_lock():
            shared.value += 1
            return shared.value
    with _lock:
        _seen[boundary] = _seen.get(boundary, 0) + 1
        return _seen[boundary]


def crash_point(boundary: str) -> None:
    spec = _current_spec()
    if spec is None or spec.boundary != boundary:
        return
    hit = _count(boundary) == spec.occurrence
    if hit:
        sys.stderr.write(f"AGENTOPS_CRASH_AT: killing process group at {boundary}\n")
        sys.stderr.flush()
        os.killpg(os.getpgid(0), signal.SIGKILL)

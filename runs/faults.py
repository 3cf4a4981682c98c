"""Fault injection (contract, DESIGN §4 and §9).

With ``AGENTOPS_CRASH_AT=<boundary>[:<n>]`` set, the worker SIGKILLs its whole ``runworker``
process group right after the commit that contains the n-th occurrence of that boundary in
that worker (default n=1) -- counted across all its cluster processes, which ``runworker``
arranges with ``share_counts()`` before it forks them.

With ``AGENTOPS_PAUSE_AT=<boundary>[:<n>]`` set, it freezes (SIGSTOP) its whole process group
at that point instead -- a VM pause, a long GC, a laptop lid. Whoever watches it resumes it
with SIGCONT (``chaos --pauses``), typically after its lease was taken over: what it does when
it wakes is what the pause tests check. ``before_send`` is the point after the pre-send check
and before a tool's request leaves. ``notify_enqueued``, ``notify_claimed`` and
``notify_sent`` are the outbox's (``runs.outbox``).

Both are inert when unset.
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
    "before_send",
    "tool_call",
    "receipt_recorded",
    "step_completed",
    "run_finished",
    # DESIGN §9: after the commit that wrote an outbox row (an email, a webhook delivery);
    # after an outbox row was claimed, before the pre-send check; after the SMTP/HTTP send,
    # before the row is marked sent
    "notify_enqueued",
    "notify_claimed",
    "notify_sent",
)

VARIABLES = ("AGENTOPS_CRASH_AT", "AGENTOPS_PAUSE_AT")


class BadCrashSpec(ValueError):
    pass


@dataclass(frozen=True)
class CrashSpec:
    boundary: str
    occurrence: int = 1


def parse_crash_spec(value: str | None, variable: str = "AGENTOPS_CRASH_AT") -> CrashSpec | None:
    if value is None or value.strip() == "":
        return None
    boundary, _, count = value.strip().partition(":")
    if boundary not in BOUNDARIES:
        raise BadCrashSpec(
            f"{variable}={value!r}: unknown boundary {boundary!r} "
            f"(expected one of {', '.join(BOUNDARIES)}, optionally followed by :N)"
        )
    if count == "":
        return CrashSpec(boundary)
    if not count.isdigit() or int(count) < 1:
        raise BadCrashSpec(f"{variable}={value!r}: the occurrence must be a positive integer")
    return CrashSpec(boundary, int(count))


def check_environment() -> None:
    """Raise ``BadCrashSpec`` (one clear line) for a malformed variable (runworker, at start)."""
    for variable in VARIABLES:
        parse_crash_spec(os.environ.get(variable), variable)


_lock = threading.Lock()
_seen: dict[tuple[str, str], int] = {}
_specs: dict[str, CrashSpec | None] = {}
_loaded = False
# one counter per variable for the whole process group, inherited by the processes forked
# after it exists
_shared_counts: dict[str, object] = {}


def _current_specs() -> dict[str, CrashSpec | None]:
    global _loaded
    if not _loaded:
        for variable in VARIABLES:
            # a malformed value is rejected by runworker at start; here it is simply inert
            try:
                _specs[variable] = parse_crash_spec(os.environ.get(variable), variable)
            except BadCrashSpec:
                _specs[variable] = None
        _loaded = True
    return _specs


def reset() -> None:
    """Forget the parsed specs and counts (tests change the environment)."""
    global _loaded
    with _lock:
        _seen.clear()
        _specs.clear()
        _loaded = False
        _shared_counts.clear()


def share_counts() -> None:
    """Count occurrences across every process forked from this one from now on (the
    django-q2 cluster runs tasks in several processes; ``:n`` means the worker's n-th)."""
    for variable, spec in _current_specs().items():
        if spec is not None:
            _shared_counts[variable] = multiprocessing.get_context("fork").Value("i", 0)


def _count(variable: str, boundary: str) -> int:
    shared = _shared_counts.get(variable)
    if shared is not None:
        with shared.get_lock():
            shared.value += 1
            return shared.value
    with _lock:
        key = (variable, boundary)
        _seen[key] = _seen.get(key, 0) + 1
        return _seen[key]


def crash_point(boundary: str) -> None:
    """The fault point ``boundary``: kill (AGENTOPS_CRASH_AT) or freeze (AGENTOPS_PAUSE_AT)
    the process group when it is the configured occurrence."""
    specs = _current_specs()
    crash = specs.get("AGENTOPS_CRASH_AT")
    hit = crash is not None and crash.boundary == boundary
    if hit and _count("AGENTOPS_CRASH_AT", boundary) == crash.occurrence:
        sys.stderr.write(f"AGENTOPS_CRASH_AT: killing process group at {boundary}\n")
        sys.stderr.flush()
        os.killpg(os.getpgid(0), signal.SIGKILL)
    pause = specs.get("AGENTOPS_PAUSE_AT")
    hit = pause is not None and pause.boundary == boundary
    if hit and _count("AGENTOPS_PAUSE_AT", boundary) == pause.occurrence:
        sys.stderr.write(f"AGENTOPS_PAUSE_AT: freezing process group at {boundary}\n")
        sys.stderr.flush()
        # the whole group, this process included: execution resumes here on SIGCONT
        os.killpg(os.getpgid(0), signal.SIGSTOP)

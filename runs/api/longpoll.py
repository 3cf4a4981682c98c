"""Long polls (issue 27): ``?wait=N`` on a read that a waiting client repeats — a run parked for
a person or an event (``GET /runs/{id}/``), a pending approval (``GET /approvals/{id}/``) — holds
the answer until what it shows changes, or N seconds (at most 30) have passed.

The hold re-reads one small row with backoff (0.1 s, doubling, at most 1 s apart: about 35
queries in 30 s), in autocommit: no transaction, no lock and no row version is held while
it waits, so it delays no writer. It does hold one of the web server's request slots (a
gunicorn thread) for up to N seconds, so each API token (or signed-in user) may hold at most
``AGENTOPS_LONG_POLLS_PER_TOKEN`` (default 2) at once in one web process; past that the
read is answered at once (``Agentops-Long-Poll: capped``), as if ``wait`` were 0. And a web
process holds at most ``AGENTOPS_LONG_POLLS_PER_PROCESS`` long polls of all tokens together
(default: half its threads), so waiting clients never take every slot from the others; past
that the read is refused, ``429 long_polls_busy`` with ``retry_after`` — the client reads
again after that long, rather than spinning on answers given at once. The header says how
every long poll ended: ``changed``, ``timeout``, ``capped``, or ``none`` (nothing to wait
for: the read was answered at once)."""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from django.conf import settings
from rest_framework import serializers

from runs.api.common import QueryParamsSerializer
from runs.errors import DomainError

WAIT_MAX_SECONDS = 30
HEADER = "Agentops-Long-Poll"
FIRST_DELAY, MAX_DELAY = 0.1, 1.0

# time.sleep, looked up at each call: a test makes the change happen "during" the hold
sleep = time.sleep

_held: Counter[Any] = Counter()
_held_lock = threading.Lock()
# every token's holds in this process together (``_held``'s total)
_PROCESS = ("process",)
# how long a refused long poll is asked to wait before reading again
BUSY_RETRY_AFTER = 2


class LongPollsBusy(DomainError):
    """This web process already holds as many long polls as it may: read again later."""

    code = "long_polls_busy"
    status = 429

    def __init__(self) -> None:
        super().__init__(
            "This server process holds as many long polls as it may; nothing was held. "
            "Read again after retry_after seconds (or without wait)."
        )

    @property
    def extra(self) -> dict[str, Any]:
        return {"retry_after": BUSY_RETRY_AFTER}


class WaitQuerySerializer(QueryParamsSerializer):
    wait = serializers.IntegerField(
        min_value=0,
        max_value=WAIT_MAX_SECONDS,
        required=False,
        default=0,
        help_text="Long poll: hold the answer until it changes, at most this many seconds "
        "(0-30). The Agentops-Long-Poll header says how it ended: changed, timeout, capped "
        "(too many of your long polls held at once: answered at once) or none (nothing to "
        "wait for).",
    )


def wait_seconds(request) -> int:
    """``?wait=`` validated (``validation_error`` with the field named otherwise)."""
    query = WaitQuerySerializer(data=request.query_params)
    query.is_valid(raise_exception=True)
    return query.validated_data["wait"]


@contextmanager
def _slot(holder: Any) -> Iterator[bool]:
    """A hold for ``holder``: ``False`` past its own cap (answer at once); ``LongPollsBusy``
    past the process's cap (the token's own comes first: its excess is answered as before)."""
    with _held_lock:
        granted = _held[holder] < settings.AGENTOPS["LONG_POLLS_PER_TOKEN"]
        if granted and _held[_PROCESS] >= settings.AGENTOPS["LONG_POLLS_PER_PROCESS"]:
            raise LongPollsBusy()
        if granted:
            _held[holder] += 1
            _held[_PROCESS] += 1
    try:
        yield granted
    finally:
        if granted:
            with _held_lock:
                for key in (holder, _PROCESS):
                    _held[key] -= 1
                    if _held[key] <= 0:
                        del _held[key]


def hold(request, read: Callable[[], Any], *, waiting: Callable[[Any], bool], seconds: int) -> str:
    """Hold the request while ``read()`` still answers what it answered first and that is a
    state ``waiting`` for something (a run parked, an approval pending), at most ``seconds``.
    Returns how the hold ended (the ``Agentops-Long-Poll`` header's value); the caller then
    reads and answers as usual."""
    if seconds <= 0:
        return "none"
    first = read()
    if not waiting(first):
        return "none"
    token = getattr(request.auth, "pk", None)
    holder = ("token", token) if token is not None else ("user", getattr(request.user, "pk", None))
    with _slot(holder) as granted:
        if not granted:
            return "capped"
        deadline = time.monotonic() + seconds
        delay = FIRST_DELAY
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                return "timeout"
            sleep(min(delay, left))
            if read() != first:
                return "changed"
            delay = min(delay * 2, MAX_DELAY)

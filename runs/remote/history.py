"""What a remote agent keeps between its processes besides steps and calls (issue 27): its
run state updated by a JSON patch (RFC 6902, ``remote_state_patch``) instead of replaced
whole, and a separate conversation history (``remote_messages_append`` /
``remote_messages_read``) from which a successor rebuilds its framework's message history.

The state patch is a fenced write like any other: the run's ``state`` and ``state_version``
change in one checkpoint with a ``run.state_patched`` event. The history is NOT part of the
record: no event, no hash chain, nothing the engine decides from (DESIGN §2: conversation
text may help rebuild context, it never replaces the record). Each message keeps who wrote it
and under which fence; its size is capped per message and per run."""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from typing import Any

import jsonpatch
import jsonpointer
from django.conf import settings
from django.db import transaction
from django.db.models import F, Max, Sum

from runs import jsonlimits
from runs.actors import Actor
from runs.models import Run, RunMessage
from runs.record.eventtypes import EventType
from runs.registry import digest
from runs.remote.lease import _held, _require_remote, honour_request, lease_holder_check
from runs.services import InvalidInput, InvalidState

# --- the state, patched ------------------------------------------------------------------------

PATCH_MAX_OPS = 1000


class InvalidPatch(InvalidInput):
    """Not an RFC 6902 patch: an unknown ``op``, a missing ``path`` or ``value``, a pointer
    that is not one."""

    code = "invalid_patch"


class _StateConflict(InvalidState):
    def __init__(self, message: str, *, state_version: int):
        super().__init__(message)
        self.extra = {"state_version": state_version}


class PatchTestFailed(_StateConflict):
    """A ``test`` operation of the patch did not hold: the state is not what the agent
    assumed. Nothing was changed."""

    code = "patch_test_failed"


class PatchNotApplicable(_StateConflict):
    """A valid patch that does not apply to the state as it is (a path that is not there, an
    index out of range, a state that would stop being an object). Nothing was changed."""

    code = "patch_not_applicable"


class StateVersionMismatch(_StateConflict):
    code = "state_version_mismatch"


def _compact_size(value: Any) -> int:
    return len(json.dumps(value, separators=(",", ":"), ensure_ascii=False).encode())


def _apply(state: dict[str, Any], patch: list[Any], version: int) -> dict[str, Any]:
    """``patch`` applied to a copy of ``state``, one operation at a time so that no ``copy``
    can grow it past the JSON rule's size before that is noticed (each copy at most doubles
    what was within the limit)."""
    _depth, max_bytes, _string = jsonlimits.limits()
    document: Any = copy.deepcopy(state)
    for index, operation in enumerate(patch):
        try:
            document = jsonpatch.JsonPatch([operation]).apply(document, in_place=True)
        except jsonpatch.JsonPatchTestFailed as exc:
            raise PatchTestFailed(
                f"operation {index} (test) failed: {exc}; nothing was changed",
                state_version=version,
            ) from None
        except (jsonpatch.JsonPatchConflict, jsonpointer.JsonPointerException) as exc:
            raise PatchNotApplicable(
                f"operation {index} ({operation.get('op')} {operation.get('path')}) does not "
                f"apply to the state: {exc}; nothing was changed",
                state_version=version,
            ) from None
        except jsonpatch.InvalidJsonPatch as exc:
            raise InvalidPatch(f"operation {index}: {exc}") from None
        except (TypeError, ValueError, KeyError, IndexError) as exc:
            # e.g. a member added inside a string: the state has no such place
            raise PatchNotApplicable(
                f"operation {index} ({operation.get('op')} {operation.get('path')}) does not "
                f"apply to the state: {exc!r}; nothing was changed",
                state_version=version,
            ) from None
        if operation.get("op") == "copy" and _compact_size(document) > max_bytes:
            raise jsonlimits.JsonRejected(
                "json_too_large", f"the patched state would be over {max_bytes} bytes"
            )
    if not isinstance(document, dict):
        raise PatchNotApplicable(
            "the run's state must stay a JSON object; nothing was changed", state_version=version
        )
    jsonlimits.check(document)
    size = _compact_size(document)
    if size > max_bytes:
        raise jsonlimits.JsonRejected(
            "json_too_large", f"the patched state would be {size} bytes; at most {max_bytes}"
        )
    return document


def _validate_patch(patch: Any) -> list[dict[str, Any]]:
    if not isinstance(patch, list) or not patch:
        raise InvalidPatch("the patch must be a non-empty JSON array of operations")
    if len(patch) > PATCH_MAX_OPS:
        raise InvalidPatch(f"at most {PATCH_MAX_OPS} operations in one patch")
    try:
        jsonpatch.JsonPatch(patch)  # checks every operation's shape before anything is read
    except (jsonpatch.InvalidJsonPatch, jsonpointer.JsonPointerException, TypeError) as exc:
        raise InvalidPatch(f"not an RFC 6902 patch: {exc}") from None
    return patch


@dataclass(frozen=True)
class StatePatched:
    state: dict[str, Any]
    state_version: int


def remote_state_patch(
    *,
    run_id: Any,
    fence: int,
    lease_token: str,
    actor: Actor,
    patch: Any,
    state_version: int | None = None,
) -> StatePatched:
    """Apply an RFC 6902 patch to the run's state, under the lease: the new state and
    ``state_version`` + 1 commit with a ``run.state_patched`` event (the operations' kinds
    and paths; values stay in the state, masked where the run is shown). ``state_version``
    (optional) is a precondition: the version the patch was made against; the patch's own
    ``test`` operations are another. Whatever fails, nothing changes: ``invalid_patch``,
    ``state_version_mismatch``, ``patch_test_failed``, ``patch_not_applicable`` (the last
    three say the current ``state_version``), or the JSON rule's codes for the result."""
    operations = _validate_patch(patch)
    lease = _held(run_id, fence, actor, lease_token)
    honour_request(lease)
    # a refusal is raised inside the checkpoint (the version is read under its lock): the
    # savepoint leaves an enclosing transaction usable after it
    with transaction.atomic(), lease.checkpoint() as cp:
        current = cp.run.state_version
        if state_version is not None and state_version != current:
            raise StateVersionMismatch(
                f"the state is at version {current}, not {state_version}: read it again "
                "(GET /runs/{id}/) and make the patch against that",
                state_version=current,
            )
        state = Run.objects.values_list("state", flat=True).get(id=run_id)
        new_state = _apply(state if isinstance(state, dict) else {}, operations, current)
        cp.update(state=new_state, state_version=F("state_version") + 1)
        cp.event(
            EventType.RUN_STATE_PATCHED,
            state_version=current + 1,
            operations=[
                {"op": op.get("op"), "path": str(op.get("path"))[:200]} for op in operations[:50]
            ],
            operation_count=len(operations),
        )
    return StatePatched(new_state, current + 1)


# --- the conversation history ------------------------------------------------------------------


class MessageTooLarge(InvalidInput):
    code = "message_too_large"


class HistoryFull(InvalidState):
    code = "history_full"


class HistoryConflict(InvalidState):
    """``after_seq`` is not the history's last message: another write came first (or this is a
    retry of an append that was recorded by another fence)."""

    code = "history_conflict"

    def __init__(self, message: str, *, last_seq: int):
        super().__init__(message)
        self.extra = {"last_seq": last_seq}


@dataclass(frozen=True)
class MessagesAppended:
    first_seq: int
    last_seq: int
    total_bytes: int
    replayed: bool = False


def _history_limits() -> tuple[int, int]:
    conf = settings.AGENTOPS
    return conf["HISTORY_MAX_MESSAGE_BYTES"], conf["HISTORY_MAX_BYTES"]


def _replayed_append(
    run_id: Any, fence: int, after_seq: int, digests: list[str]
) -> MessagesAppended | None:
    """A retried append (same fence, ``after_seq`` and messages) whose first attempt was
    recorded: answered from the record."""
    stored = list(
        RunMessage.objects.filter(
            run_id=run_id, seq__gt=after_seq, seq__lte=after_seq + len(digests)
        )
        .order_by("seq")
        .values_list("digest", "incarnation")
    )
    if [d for d, _ in stored] != digests or any(inc != fence for _, inc in stored):
        return None
    total = RunMessage.objects.filter(run_id=run_id).aggregate(total=Sum("size"))["total"] or 0
    return MessagesAppended(after_seq + 1, after_seq + len(digests), total, True)


def remote_messages_append(
    *,
    run_id: Any,
    fence: int,
    lease_token: str,
    actor: Actor,
    messages: Any,
    after_seq: int | None = None,
) -> MessagesAppended:
    """Append ``messages`` (JSON objects: the framework's own message objects) to the
    run's history, in order, under the lease. ``after_seq`` (optional): the seq of the last
    message this process knows of — the append is refused (``history_conflict``, with the
    real ``last_seq``) if another came since, and a retry of a recorded append (same fence,
    ``after_seq`` and messages) answers the same without storing them twice. Limits:
    ``message_too_large`` (one message over ``HISTORY_MAX_MESSAGE_BYTES``), ``history_full``
    (the run's history would pass ``HISTORY_MAX_BYTES``). Not part of the record: no event."""
    if not isinstance(messages, list) or not messages:
        raise InvalidInput("messages must be a non-empty JSON array")
    if not all(isinstance(message, dict) for message in messages):
        raise InvalidInput("each message must be a JSON object")
    max_message, max_total = _history_limits()
    sizes = [_compact_size(message) for message in messages]
    for index, size in enumerate(sizes):
        if size > max_message:
            raise MessageTooLarge(
                f"message {index} is {size} bytes of JSON; at most {max_message} per message"
            )
    digests = [digest(message) for message in messages]
    if after_seq is not None:
        _require_remote(run_id, actor)
        lease_holder_check(run_id, fence, actor, lease_token)
        replayed = _replayed_append(run_id, fence, after_seq, digests)
        if replayed is not None:
            return replayed
    lease = _held(run_id, fence, actor, lease_token)
    with transaction.atomic(), lease.checkpoint():
        # the run's row is locked: appends to one history are serialised
        stored = RunMessage.objects.filter(run_id=run_id).aggregate(
            last=Max("seq"), total=Sum("size")
        )
        last, total = stored["last"] or 0, stored["total"] or 0
        if after_seq is not None and after_seq != last:
            raise HistoryConflict(
                f"the history's last message is {last}, not {after_seq}: read it again",
                last_seq=last,
            )
        if total + sum(sizes) > max_total:
            raise HistoryFull(
                f"the run's history holds {total} bytes; {sum(sizes)} more would pass its "
                f"limit of {max_total}"
            )
        RunMessage.objects.bulk_create(
            RunMessage(
                run_id=run_id,
                seq=last + 1 + index,
                message=message,
                size=sizes[index],
                digest=digests[index],
                written_by=lease.actor,
                incarnation=fence,
            )
            for index, message in enumerate(messages)
        )
    return MessagesAppended(last + 1, last + len(messages), total + sum(sizes))


def remote_messages_read(*, run_id: Any, actor: Actor, after_seq: int = 0, limit: int = 100):
    """The history's messages after ``after_seq``, oldest first, at most ``limit``: for the
    principal that drives the agent's runs only (it may hold what the agent saw unmasked)."""
    _require_remote(run_id, actor)
    return list(RunMessage.objects.filter(run_id=run_id, seq__gt=after_seq).order_by("seq")[:limit])

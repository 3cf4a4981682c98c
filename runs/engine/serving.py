"""Rolling deploys: a worker hands a run its code cannot serve to a live worker whose code
can, instead of parking it for a person.

While old and new workers run side by side, a run may be claimed by a worker of the other
release: an old worker meets a run started on the new agent version (no migration leads
back), or a call decided under a tool fingerprint it does not know. Parking would strand the
run although a worker that serves it is running. Each worker records what it serves
(``Registry.serves``, on its ``Worker`` row at start); on those paths only — never on the
hot path — the engine looks for another live worker that serves the run's agent version (and
the call's tool fingerprint), and if there is one releases the run to be claimed again
shortly (``run.handed_off``). With none, the rules that applied before hold (migrate, park,
re-bind), so a run nobody serves is visible as it always was.
"""

from __future__ import annotations

from datetime import timedelta

from django.conf import settings
from django.db.models.functions import Now

from runs.engine.lease import Lease, _conf
from runs.models import Worker
from runs.record.eventtypes import EventType
from runs.record.runs import run_release


def _serves(serves: dict, agent: str, version: str, tool: tuple[str, str] | None) -> bool:
    if version not in (serves.get("agents") or {}).get(agent, ()):
        return False
    return tool is None or tool[1] in (serves.get("tools") or {}).get(tool[0], ())


def hand_off(lease: Lease, why: str, *, tool: tuple[str, str] | None = None) -> bool:
    """Release the run for a live worker that serves its agent version (and ``tool``, a
    call's (name, fingerprint)); False, doing nothing, when there is none."""
    stale_after = timedelta(seconds=settings.AGENTOPS["WORKER_STALE_AFTER"])
    live = (
        Worker.objects.filter(
            heartbeat_at__gt=Now() - stale_after,
            health__in=(Worker.Health.STARTING, Worker.Health.HEALTHY),
        )
        .exclude(name=lease.worker)
        .values_list("name", "serves")
    )
    run = lease.run
    able = sorted(
        name for name, serves in live if _serves(serves, run.agent_name, run.agent_version, tool)
    )
    if not able:
        return False
    wake_at = lease.now() + timedelta(seconds=_conf("HANDOFF_DELAY"))
    with lease.checkpoint() as cp:
        cp.event(EventType.RUN_HANDED_OFF, worker=lease.worker, reason=why, to=able)
        run_release(cp, wake_at=wake_at)
        # ``enqueued_at`` cleared: the sweeper wakes the run as soon as ``wake_at`` is due
        # (a worker of either release may take it: a short delay, not a busy loop)
        cp.update(enqueued_at=None)
    return True

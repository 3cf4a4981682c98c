"""The per-run hash chain of the record (docs/audit.md): every event's hash covers its
fields, its payload's digest and the previous event's hash; the first links to the run's
anchor."""

from __future__ import annotations

import hashlib
import json
from typing import Any


def anchor_hash(run_id: Any) -> str:
    return hashlib.sha256(f"agentops-run:{run_id}".encode()).hexdigest()


def payload_digest(payload: Any) -> str:
    canonical = json.dumps(payload, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(canonical.encode()).hexdigest()


def event_hash(event: Any) -> str:
    """Hash over the event's fields, its payload digest and the previous event's hash."""
    parts = [
        event.prev_hash,
        str(event.run_id),
        str(event.seq),
        event.created_at.isoformat(),
        event.type,
        event.actor,
        event.channel,
        "" if event.incarnation is None else str(event.incarnation),
        event.payload_digest,
    ]
    return hashlib.sha256("|".join(parts).encode()).hexdigest()

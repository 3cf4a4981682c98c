"""Who did it, and through which channel (DESIGN §2). Every event names an actor."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


class PermissionDenied(Exception):
    code = "permission_denied"


@dataclass(frozen=True)
class Actor:
    label: str
    channel: str
    user: Any = None  # a django User for people and service accounts

    @classmethod
    def for_user(cls, user: Any, channel: str) -> Actor:
        return cls(label=f"user:{user.get_username()}", channel=channel, user=user)

    @classmethod
    def worker(cls, name: str) -> Actor:
        return cls(label=f"worker:{name}", channel="worker")

    @classmethod
    def system(cls, channel: str = "worker") -> Actor:
        return cls(label="system", channel=channel)

    def require(self, perm: str) -> None:
        """System actors (workers, the sweeper) act on the record's own rules; people and
        tokens need the permission."""
        if self.user is None:
            return
        if not (self.user.is_active and self.user.has_perm(perm)):
            raise PermissionDenied(f"{self.label} lacks permission {perm}")

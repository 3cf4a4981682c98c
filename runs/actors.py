"""Who did it, and through which channel (DESIGN §2). Every event names an actor.

Also the one place that decides what an actor may do (issue 16): a Django permission
(``require``), and for the ``agent`` role (service accounts driving remote agents) the
permission *and* ownership of the agent (``require_driver``), the groups its manifest lets
it ask (``require_question_to``), and which runs it may read (``run_read_scope``). Services
call these; views and serializers never decide permissions themselves.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from django.db.models import Q

from runs import errors

# the agent role's one permission (the role holds nothing else): lease, drive and read the
# runs of the remote agents whose manifests name the principal as their owner
DRIVE_REMOTE_RUN = "runs.drive_remote_run"


PermissionDenied = errors.PermissionDenied  # the one choke point's refusal (runs.errors)


def _active(user: Any) -> bool:
    return bool(user is not None and user.is_active)


def _owns_agent(user: Any, agent_name: str) -> bool:
    from runs.models import AgentManifest

    return AgentManifest.objects.filter(name=agent_name, owner_id=user.pk).exists()


def run_read_scope(user: Any, prefix: str = "", perm: str = "runs.view_run") -> Q | None:
    """The runs ``user`` may read (their records of kind ``perm``), as a filter (``prefix``:
    the path to the run, e.g. ``"run__"`` for tool calls): every run with ``perm``; with the
    agent role only its own agents' runs; None: no run at all."""
    if not _active(user):
        return None
    if user.has_perm(perm):
        return Q()
    if user.has_perm(DRIVE_REMOTE_RUN):
        from runs.models import AgentManifest

        owned = AgentManifest.objects.filter(owner_id=user.pk).values("name")
        return Q(**{f"{prefix}agent_name__in": owned})
    return None


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
        if not (_active(self.user) and self.user.has_perm(perm)):
            raise PermissionDenied(f"{self.label} lacks permission {perm}")

    def require_driver(self, agent_name: str) -> None:
        """Lease and drive a remote agent's runs: the agent role's permission and being the
        owner its manifest names (an admin's audited choice). Nobody else — no operator, no
        superuser — holds a remote lease, so nobody else receives the unmasked arguments of
        its calls. Ownership is read from the record each time: an admin who names another
        owner stops the old one at its next write."""
        self.require(DRIVE_REMOTE_RUN)
        if self.user is not None and not _owns_agent(self.user, agent_name):
            raise PermissionDenied(f"{self.label} does not own the agent {agent_name}")

    def require_question_to(self, agent_name: str, group: str) -> None:
        """A remote agent's run asks (and emails its free text to) only the groups its
        manifest declares in ``question_groups``."""
        from runs.models import AgentManifest

        declared = (
            AgentManifest.objects.filter(name=agent_name)
            .values_list("question_groups", flat=True)
            .first()
        )
        if group not in (declared or []):
            raise PermissionDenied(
                f"the manifest of {agent_name} declares no questions to the group {group!r} "
                "(question_groups; an admin changes it)"
            )

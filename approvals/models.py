"""Approvals bound to the exact call they allow (DESIGN §7)."""

from __future__ import annotations

from django.conf import settings
from django.db import models
from django.db.models import Q

from runs.models import Channel, Run, ToolCall
from runs.registry import OnExpiry as PolicyOnExpiry


class Approval(models.Model):
    class Status(models.TextChoices):
        PENDING = "pending"
        APPROVED = "approved"
        REJECTED = "rejected"
        EXPIRED = "expired"
        CANCELLED = "cancelled"

    class OnExpiry(models.TextChoices):
        """What happens when it expires undecided: the tool's policy declares it
        (``runs.registry.OnExpiry``, the one catalogue; tests/test_catalogues.py keeps these
        equal)."""

        REJECT = PolicyOnExpiry.REJECT.value
        TERMINATE = PolicyOnExpiry.TERMINATE.value
        ESCALATE = PolicyOnExpiry.ESCALATE.value

    run = models.ForeignKey(Run, on_delete=models.CASCADE, related_name="approvals")
    tool_call = models.ForeignKey(ToolCall, on_delete=models.CASCADE, related_name="approvals")
    status = models.CharField(max_length=20, choices=Status.choices, default=Status.PENDING)
    # bound to the exact call: tool, tool version, argument digest, precondition
    tool_name = models.CharField(max_length=100)
    tool_version = models.CharField(max_length=64)
    arguments_digest = models.CharField(max_length=64)
    precondition_fingerprint = models.CharField(max_length=128, blank=True)
    arguments_masked = models.JSONField(default=dict)
    approver_group = models.CharField(max_length=150)
    required_count = models.PositiveSmallIntegerField(default=1)
    # per-group minimums within ``required_count`` ({"finance": 1}: at least one of the
    # approvers from finance); their members may decide too (approvals.quorum)
    group_minimums = models.JSONField(default=dict, blank=True)
    allow_self_approval = models.BooleanField(default=False)
    # email links must be used by their approver, signed in (every policy but one with
    # ``bearer_links``, a 1-of-1 opt-in)
    require_login = models.BooleanField(default=True)
    # nobody who started, forked, signalled or resolved the run may decide (policy
    # ``separate_duties``)
    separate_duties = models.BooleanField(default=True)
    on_expiry = models.CharField(max_length=20, choices=OnExpiry.choices, default=OnExpiry.REJECT)
    # the policy's escalation, copied like the rest of it: an escalation follows the policy
    # that asked, not whatever the code says when the approval expires (a deploy in between).
    # ``ttl_seconds`` None: requested before these were copied (the code's policy is used).
    escalate_to = models.CharField(max_length=150, blank=True)
    ttl_seconds = models.PositiveIntegerField(null=True, blank=True)
    requested_at = models.DateTimeField(auto_now_add=True)
    expires_at = models.DateTimeField()
    decided_at = models.DateTimeField(null=True, blank=True)
    consumed_at = models.DateTimeField(null=True, blank=True)
    # set by the one sweep pass that sends the reminder (a conditional UPDATE: sent once)
    reminder_sent_at = models.DateTimeField(null=True, blank=True)
    reason = models.TextField(blank=True)
    # the data policy version that required this approval (None: the tool's code policy)
    policy_version = models.ForeignKey(
        "ApprovalPolicyVersion",
        on_delete=models.PROTECT,
        related_name="approvals",
        null=True,
        blank=True,
    )

    class Meta:
        ordering = ["-requested_at"]
        permissions = [("decide_approval", "Can decide approvals")]
        constraints = [
            # at most one live approval per call
            models.UniqueConstraint(
                fields=["tool_call"],
                condition=Q(status__in=["pending", "approved"]) & Q(consumed_at__isnull=True),
                name="approval_one_live_per_call",
            )
        ]
        indexes = [
            models.Index(
                fields=["expires_at"], name="approval_pending_idx", condition=Q(status="pending")
            ),
        ]

    def __str__(self) -> str:
        return f"approval {self.id} for {self.tool_name} ({self.status})"

    @property
    def eligible_groups(self) -> list[str]:
        """Whose members may decide: the approval's group, then each group with a minimum."""
        return [
            self.approver_group,
            *(g for g in sorted(self.group_minimums or {}) if g != self.approver_group),
        ]


class ApprovalDecision(models.Model):
    class Decision(models.TextChoices):
        APPROVE = "approve"
        REJECT = "reject"
        # a remark that decides nothing; a person may comment and still decide later
        COMMENT = "comment"

    DECIDING = (Decision.APPROVE, Decision.REJECT)

    approval = models.ForeignKey(Approval, on_delete=models.CASCADE, related_name="decisions")
    decider = models.ForeignKey(
        settings.AUTH_USER_MODEL, on_delete=models.PROTECT, related_name="+"
    )
    channel = models.CharField(max_length=20, choices=Channel.choices)
    decision = models.CharField(max_length=20, choices=Decision.choices)
    comment = models.TextField(blank=True)
    # approve-with-edits: both copies masked (the real arguments live only on the ToolCall),
    # side by side with the digests that bind the approval before and after the edit
    edited_arguments = models.JSONField(null=True, blank=True)
    original_arguments = models.JSONField(null=True, blank=True)
    original_digest = models.CharField(max_length=64, blank=True)
    edited_digest = models.CharField(max_length=64, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["created_at"]
        constraints = [
            # each person decides at most once (comments are not decisions)
            models.UniqueConstraint(
                fields=["approval", "decider"],
                condition=Q(decision__in=["approve", "reject"]),
                name="decision_once_per_person",
            )
        ]

    def __str__(self) -> str:
        return f"{self.decision} by {self.decider_id}"


class ApprovalLink(models.Model):
    """One emailed link: a random token (only its sha256 is stored) for one approver of one
    approval. Single-use; it expires with the approval."""

    class Kind(models.TextChoices):
        REQUEST = "request"
        REMINDER = "reminder"

    approval = models.ForeignKey(Approval, on_delete=models.CASCADE, related_name="links")
    approver = models.ForeignKey(
        settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="+"
    )
    token_hash = models.CharField(max_length=64, unique=True)
    kind = models.CharField(max_length=20, choices=Kind.choices, default=Kind.REQUEST)
    created_at = models.DateTimeField(auto_now_add=True)
    used_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["created_at"]

    def __str__(self) -> str:
        return f"link for {self.approver_id} on approval {self.approval_id}"


# --- approval policies as data (docs/approvals.md, "Policies") --------------------------------


class ImmutableVersion(Exception):
    """An integrity guard (as ``runs.models.AppendOnlyError``): a published or drafted
    version is never edited through the ORM. A bug if reached, not a user's error."""


class ApprovalPolicy(models.Model):
    """The data policy of one tool, optionally for one agent and/or one principal group.
    Its rules live in ``ApprovalPolicyVersion`` rows: a change is a new version, never an
    edit. With no published version the tool's code policy applies."""

    tool_name = models.CharField(max_length=100)
    # scope: empty means every agent / every principal; the most specific policy wins
    agent_name = models.CharField(max_length=100, blank=True)
    principal_group = models.CharField(max_length=150, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)
    created_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, on_delete=models.PROTECT, related_name="+", null=True
    )

    class Meta:
        ordering = ["tool_name", "agent_name", "principal_group"]
        verbose_name_plural = "approval policies"
        permissions = [
            ("manage_approvalpolicy", "Can draft, simulate and publish approval policies")
        ]
        constraints = [
            models.UniqueConstraint(
                fields=["tool_name", "agent_name", "principal_group"], name="policy_one_per_scope"
            )
        ]

    def __str__(self) -> str:
        return f"policy for {self.tool_name}{self.scope_label}"

    @property
    def scope_label(self) -> str:
        parts = []
        if self.agent_name:
            parts.append(f"agent {self.agent_name}")
        if self.principal_group:
            parts.append(f"principals in {self.principal_group}")
        return f" ({', '.join(parts)})" if parts else ""


class ApprovalPolicyVersion(models.Model):
    """One version of a policy's rules. Written once: its rules, time zone and note never
    change (``save`` refuses); only its publication is recorded on it (a draft becomes
    ``published``, the version it replaces ``superseded``)."""

    class Status(models.TextChoices):
        DRAFT = "draft"
        PUBLISHED = "published"
        SUPERSEDED = "superseded"
        DISCARDED = "discarded"

    policy = models.ForeignKey(ApprovalPolicy, on_delete=models.PROTECT, related_name="versions")
    number = models.PositiveIntegerField()
    status = models.CharField(max_length=20, choices=Status.choices, default=Status.DRAFT)
    rules = models.JSONField(default=list)
    time_zone = models.CharField(max_length=64, default="UTC")
    # why: required of every version (the audit trail's "who, when, why")
    note = models.TextField()
    # the published version this draft was written against: publishing it after another
    # version was published meanwhile is refused (it would silently undo that change)
    based_on = models.ForeignKey(
        "self", on_delete=models.PROTECT, related_name="+", null=True, blank=True
    )
    created_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, on_delete=models.PROTECT, related_name="+"
    )
    created_at = models.DateTimeField(auto_now_add=True)
    published_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, on_delete=models.PROTECT, related_name="+", null=True
    )
    published_at = models.DateTimeField(null=True, blank=True)
    # what the simulation last run on this draft found (counts), for the publish page
    simulated = models.JSONField(null=True, blank=True)
    # a withdrawal: published, it takes the policy out of force (no rules of its own): the
    # next broader data policy applies, or the tool's code policy
    withdraws = models.BooleanField(default=False)

    # the fields that may change after the version is written: its publication
    MUTABLE = frozenset({"status", "published_by", "published_at", "simulated"})

    class Meta:
        ordering = ["policy", "-number"]
        constraints = [
            models.UniqueConstraint(fields=["policy", "number"], name="policy_version_number"),
            # one current version per policy
            models.UniqueConstraint(
                fields=["policy"], condition=Q(status="published"), name="policy_one_published"
            ),
        ]

    def __str__(self) -> str:
        return f"{self.policy} v{self.number} ({self.status})"

    def save(self, *args, **kwargs):
        # an integrity guard (CONVENTIONS 3): a version's content is written once
        if not self._state.adding:
            fields = kwargs.get("update_fields")
            if fields is None or not set(fields) <= self.MUTABLE:
                raise ImmutableVersion("a policy version is never edited: draft a new one")
        super().save(*args, **kwargs)

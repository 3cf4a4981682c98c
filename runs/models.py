# size: the record's models in one module, as Django's app layout expects: each model is short,
# and the record reads best as one table of them (docs/architecture.md, "The record")
"""The authoritative record (DESIGN §2). The database is the only truth.

State changes happen in ``runs.services`` and ``runs.engine`` only; models hold no logic,
except the integrity guard that makes ``RunEvent`` append-only.
"""

from __future__ import annotations

import uuid

from django.conf import settings
from django.db import models
from django.db.models import Q
from django.utils import timezone

from runs.registry import Effect


class Channel(models.TextChoices):
    """How a person or a process reached the record (DESIGN §2, contract): an event's, a
    signal's, an answer's, a decision's channel (``RunEvent.Channel``)."""

    WEB = "web"
    EMAIL = "email"
    API = "api"
    ADMIN = "admin"
    CLI = "cli"
    WORKER = "worker"


class Run(models.Model):
    class Status(models.TextChoices):
        QUEUED = "queued"
        RUNNING = "running"
        WAITING_APPROVAL = "waiting_approval"
        WAITING_EVENT = "waiting_event"
        NEEDS_ATTENTION = "needs_attention"
        PAUSED = "paused"
        SUCCEEDED = "succeeded"
        FAILED = "failed"
        TERMINATED = "terminated"

    class Reason(models.TextChoices):
        UNKNOWN_OUTCOME = "unknown_outcome"
        RECOVERY_LIMIT = "recovery_limit"
        BUDGET_EXHAUSTED = "budget_exhausted"
        INCOMPATIBLE_AGENT_VERSION = "incompatible_agent_version"
        TOOL_RETIRED = "tool_retired"
        PRINCIPAL_REVOKED = "principal_revoked"
        APPROVAL_REJECTED = "approval_rejected"
        APPROVAL_EXPIRED = "approval_expired"
        OPERATOR_TERMINATED = "operator_terminated"
        AGENT_FAILED = "agent_failed"
        # a tool's precondition raised (its resource deleted, its service down): the call
        # waits for a person instead of crashing every incarnation up to the recovery limit
        PRECONDITION_FAILED = "precondition_failed"
        # the model the run is pinned to is gone (withdrawn by its provider): a person moves
        # the run to the configured model (retry) instead of the run failing for good
        MODEL_UNAVAILABLE = "model_unavailable"

    class Request(models.TextChoices):
        """An operator's request the lease holder honours at its next boundary."""

        NONE = ""
        PAUSE = "pause"
        TERMINATE = "terminate"

    RUNNABLE = (Status.QUEUED, Status.RUNNING)
    TERMINAL = (Status.SUCCEEDED, Status.FAILED, Status.TERMINATED)

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    agent_name = models.CharField(max_length=100)
    agent_version = models.CharField(max_length=50)
    goal = models.TextField(blank=True)
    input = models.JSONField(default=dict, blank=True)
    state = models.JSONField(default=dict, blank=True)
    state_version = models.PositiveIntegerField(default=0)
    result = models.JSONField(null=True, blank=True)
    status = models.CharField(max_length=20, choices=Status.choices, default=Status.QUEUED)
    reason_code = models.CharField(max_length=40, choices=Reason.choices, blank=True)
    reason_detail = models.TextField(blank=True)
    principal = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.PROTECT, related_name="+"
    )

    # budgets: limits and *persisted* usage (never reset by a restart)
    max_steps = models.PositiveIntegerField(null=True, blank=True)
    max_cost = models.DecimalField(max_digits=12, decimal_places=6, null=True, blank=True)
    max_tokens = models.PositiveBigIntegerField(null=True, blank=True)
    deadline = models.DateTimeField(null=True, blank=True)
    steps_used = models.PositiveIntegerField(default=0)
    cost_used = models.DecimalField(max_digits=12, decimal_places=6, default=0)
    tokens_used = models.PositiveBigIntegerField(default=0)

    # lease and fencing (DESIGN §3)
    lease_owner = models.CharField(max_length=200, blank=True)
    lease_expires_at = models.DateTimeField(null=True, blank=True)
    fence = models.PositiveBigIntegerField(default=0)
    # A remote lease's secret (runs.remote.lease): the SHA-256 of the token the claim that
    # set ``fence`` returned, and the principal it was returned to. Every fenced write of the
    # remote protocol presents the token; the fence alone is visible to every viewer. Kept
    # after a release (the next claim replaces both) so that a retried write of that
    # incarnation can still prove it is the one that made the first attempt.
    lease_token_hash = models.CharField(max_length=64, blank=True, default="")
    lease_holder = models.ForeignKey(
        settings.AUTH_USER_MODEL,
        null=True,
        blank=True,
        on_delete=models.SET_NULL,
        related_name="+",
    )
    recovery_count = models.PositiveIntegerField(default=0)
    # recovery_count when an operator last retried a dead-lettered run: the limit counts the
    # recoveries since then, while recovery_count itself is never reset (it is history)
    recovery_count_at_retry = models.PositiveIntegerField(default=0)
    # not runnable before this time (reconciliation backoff, timers)
    wake_at = models.DateTimeField(null=True, blank=True)
    # when a wake-up task was last enqueued: the sweeper re-enqueues if nobody claimed it
    enqueued_at = models.DateTimeField(null=True, blank=True)
    requested_action = models.CharField(max_length=20, choices=Request.choices, blank=True)
    requested_by = models.CharField(max_length=200, blank=True)
    requested_reason = models.TextField(blank=True)

    trace_id = models.CharField(max_length=32, default="", editable=False)
    # LLM-backed agents: the model id is pinned on the run when it starts (DESIGN §5.2);
    # a later settings change does not move a live run to another model.
    model_id = models.CharField(max_length=200, blank=True)
    root_run = models.ForeignKey(
        "self", null=True, blank=True, on_delete=models.PROTECT, related_name="descendants"
    )
    # a fork continues another run from one of its completed steps (DESIGN §5.2)
    forked_from = models.ForeignKey(
        "self", null=True, blank=True, on_delete=models.PROTECT, related_name="forks"
    )
    forked_from_step = models.PositiveIntegerField(null=True, blank=True)
    # A dry run (issue 23): the agent runs for real, but every tool that is not ``read``
    # goes through the tool's declared ``dry_run`` instead of its side effect (hosted), or is
    # flagged "do not execute" to the process that would call it (remote agents). Fixed at
    # creation; a fork of a dry run is a dry run.
    # (db_default: code of the previous release still inserts runs during a rolling deploy)
    dry_run = models.BooleanField(default=False, db_default=False)
    # the finished dry run this run was promoted from: started for real with the same input,
    # none of its decisions reused (``run_promote``); its ``promotions`` are the other way
    promoted_from = models.OneToOneField(
        "self", null=True, blank=True, on_delete=models.PROTECT, related_name="promoted_to"
    )
    event_seq = models.PositiveBigIntegerField(default=0)
    last_event_hash = models.CharField(max_length=64, blank=True)

    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)
    finished_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-created_at"]
        permissions = [
            ("start_run", "Can start runs"),
            ("operate_run", "Can pause, resume, terminate and recover runs"),
            ("resolve_toolcall", "Can resolve unknown tool outcomes"),
            # runs.masking: values a tool declared sensitive in its result, unmasked
            ("view_sensitive", "Can see sensitive tool output unmasked"),
            # the agent role: lease and drive the runs of the remote agents one owns
            ("drive_remote_run", "Can lease and drive runs of the remote agents it owns"),
        ]
        indexes = [
            # the sweeper: runnable runs (few at any time), then their leases are checked
            models.Index(
                fields=["created_at"],
                name="run_runnable_idx",
                condition=Q(status__in=["queued", "running"]),
            ),
            models.Index(fields=["status", "-created_at"], name="run_status_created_idx"),
            # the runs list's default sort (keyset pagination on time, then id). No index
            # holds updated_at or lease_expires_at: every checkpoint changes both, and an
            # update that touches no indexed column stays HOT (docs/benchmarks.md)
            models.Index(fields=["-created_at", "-id"], name="run_created_idx"),
            models.Index(fields=["agent_name", "-created_at"], name="run_agent_created_idx"),
            # the runs list's filters by reason and by principal, newest first: without them
            # a rare value walks every run (seconds at a million: docs/benchmarks.md, Scale);
            # set once per run (a park, the end), never on a step: updates stay HOT
            models.Index(
                fields=["reason_code", "-created_at"],
                name="run_reason_created_idx",
                condition=~Q(reason_code=""),
            ),
            models.Index(fields=["principal", "-created_at"], name="run_principal_created_idx"),
            models.Index(fields=["lease_owner"], name="run_lease_owner_idx"),
            # the sweeper: waits whose timer or timeout fell due (runs.record.common.claimable)
            models.Index(
                fields=["wake_at"],
                name="run_wait_due_idx",
                condition=Q(status="waiting_event"),
            ),
        ]

    def __str__(self) -> str:
        return f"{self.agent_name} {self.id} ({self.status})"

    @property
    def is_terminal(self) -> bool:
        return self.status in self.TERMINAL


class Step(models.Model):
    class Kind(models.TextChoices):
        TOOL_CALL = "tool_call"
        WAIT = "wait"
        FINISH = "finish"
        FAIL = "fail"
        DECISION = "decision"  # a remote agent's own checkpointed decision (runs.remote)

    class Status(models.TextChoices):
        PENDING = "pending"
        COMPLETED = "completed"
        FAILED = "failed"

    # no index of its own: step_run_seq_uniq (run, seq) serves lookups by run
    run = models.ForeignKey(Run, on_delete=models.CASCADE, related_name="steps", db_index=False)
    seq = models.PositiveIntegerField()
    kind = models.CharField(max_length=20, choices=Kind.choices)
    status = models.CharField(max_length=20, choices=Status.choices, default=Status.PENDING)
    input = models.JSONField(default=dict, blank=True)
    output = models.JSONField(null=True, blank=True)
    error = models.TextField(blank=True)
    incarnation = models.PositiveBigIntegerField()
    cost = models.DecimalField(max_digits=12, decimal_places=6, default=0)
    tokens = models.PositiveBigIntegerField(default=0)
    created_at = models.DateTimeField(auto_now_add=True)
    completed_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["run", "seq"]
        constraints = [models.UniqueConstraint(fields=["run", "seq"], name="step_run_seq_uniq")]

    def __str__(self) -> str:
        return f"step {self.seq} {self.kind} ({self.status})"


class ToolCall(models.Model):
    class Status(models.TextChoices):
        PROPOSED = "proposed"
        AWAITING_APPROVAL = "awaiting_approval"
        APPROVED = "approved"
        REJECTED = "rejected"
        DISPATCHING = "dispatching"
        SUCCEEDED = "succeeded"
        FAILED = "failed"
        UNKNOWN = "unknown"
        CANCELLED = "cancelled"

    OPEN = (
        Status.PROPOSED,
        Status.AWAITING_APPROVAL,
        Status.APPROVED,
        Status.DISPATCHING,
        Status.UNKNOWN,
    )

    step = models.OneToOneField(Step, on_delete=models.CASCADE, related_name="tool_call")
    # no index of its own: toolcall_run_key_uniq (run, idempotency_key) serves it
    run = models.ForeignKey(
        Run, on_delete=models.CASCADE, related_name="tool_calls", db_index=False
    )
    tool_name = models.CharField(max_length=100)
    tool_version = models.CharField(max_length=64)
    # the tool's effect class (runs.registry.Effect, the one catalogue)
    effect = models.CharField(max_length=20, choices=[(e.value, e.value) for e in Effect])
    # the real arguments live only here; events, pages and emails get the masked copy
    arguments = models.JSONField(default=dict)
    arguments_masked = models.JSONField(default=dict)
    arguments_digest = models.CharField(max_length=64)
    # <root run id>:<step seq>: stable across recoveries and forks. Unique per run, not
    # globally: a fork carries its parent's calls with their keys, and a fork's new call at
    # a seq its family already used either shares that key (the same call: reconciled,
    # never blindly repeated) or takes ``<fork run id>:<seq>`` (a different call).
    idempotency_key = models.CharField(max_length=100)
    # a remote agent's own id for the call (its framework's tool-call id), empty if none:
    # proposing it again in the run answers this call (runs.remote.toolcalls)
    client_call_id = models.CharField(max_length=200, blank=True, default="")
    status = models.CharField(max_length=20, choices=Status.choices, default=Status.PROPOSED)
    attempt_count = models.PositiveIntegerField(default=0)
    dispatched_at = models.DateTimeField(null=True, blank=True)
    dispatch_incarnation = models.PositiveBigIntegerField(null=True, blank=True)
    precondition_fingerprint = models.CharField(max_length=128, blank=True)
    reconcile_attempts = models.PositiveIntegerField(default=0)
    # an operator resolved the unknown outcome with "dispatch again": the call stays
    # ``unknown`` (the first attempt's fate is still not known) until it is re-dispatched
    redispatch_authorized = models.BooleanField(default=False)
    next_reconcile_at = models.DateTimeField(null=True, blank=True)
    # DESIGN §9, both in database time, set by the ``dispatching`` statement of the latest
    # attempt: its request may not leave after ``send_deadline`` (never later than the lease
    # that dispatched it), and may still land until ``landing_deadline`` (send deadline + the
    # tool's total timeout + a margin). An ``absent`` lookup authorises a re-send only when
    # the lookup *started* after the landing deadline.
    send_deadline = models.DateTimeField(null=True, blank=True)
    landing_deadline = models.DateTimeField(null=True, blank=True)
    # the latest reconciliation lookup begun (server time) and how many were begun: a
    # remote agent's ``absent`` names the lookup it reports (runs.remote.toolcalls)
    lookup_started_at = models.DateTimeField(null=True, blank=True)
    lookups_begun = models.PositiveIntegerField(default=0)
    # a remote agent's ``absent`` that was accepted (its lookup started after the landing
    # deadline): the number of that lookup. It lets the call be dispatched again only while
    # no lookup was begun since and no operator restarted the rules (toolcall_resolve)
    absent_lookup = models.PositiveIntegerField(null=True, blank=True)
    last_error = models.TextField(blank=True)
    # what an approval policy could read when the call was decided besides its arguments
    # (runs.gate.policy_facts: principal, groups, agent, spend so far, time): a policy is
    # re-evaluated at the dispatch, and simulated against history, on these
    policy_input = models.JSONField(default=dict, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["run", "step__seq"]
        constraints = [
            models.UniqueConstraint(
                fields=["run", "idempotency_key"], name="toolcall_run_key_uniq"
            ),
            models.UniqueConstraint(
                fields=["run", "client_call_id"],
                condition=~Q(client_call_id=""),
                name="toolcall_run_client_id_uniq",
            ),
        ]
        indexes = [
            models.Index(
                fields=["status", "updated_at"],
                name="toolcall_unknown_idx",
                condition=Q(status="unknown"),
            ),
            # a family's call under a key (engine.family_call); no LIKE index: exact lookups
            models.Index(fields=["idempotency_key"], name="toolcall_key_idx"),
            # calls not settled yet (metrics); settled calls, nearly all of them, stay out
            models.Index(
                fields=["status"],
                name="toolcall_open_idx",
                # ToolCall.OPEN (not reachable from Meta)
                condition=Q(
                    status__in=[
                        "proposed",
                        "awaiting_approval",
                        "approved",
                        "dispatching",
                        "unknown",
                    ]
                ),
            ),
        ]

    def __str__(self) -> str:
        return f"{self.tool_name} {self.idempotency_key} ({self.status})"


class ToolReceipt(models.Model):
    class Outcome(models.TextChoices):
        SUCCEEDED = "succeeded"
        FAILED = "failed"

    class Source(models.TextChoices):
        TOOL = "tool"
        RECONCILIATION = "reconciliation"
        OPERATOR = "operator"
        AGENT = "agent"
        # a dry run's call of a tool that is not ``read``: what the tool's ``dry_run`` (or a
        # remote agent's simulation) answered; nothing was sent to the external system
        SIMULATED = "simulated"

    tool_call = models.OneToOneField(ToolCall, on_delete=models.CASCADE, related_name="receipt")
    outcome = models.CharField(max_length=20, choices=Outcome.choices)
    result = models.JSONField(null=True, blank=True)
    external_ref = models.CharField(max_length=200, blank=True)
    source = models.CharField(max_length=20, choices=Source.choices)
    recorded_by = models.CharField(max_length=200)
    incarnation = models.PositiveBigIntegerField(null=True, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        indexes = [models.Index(fields=["external_ref"], name="receipt_external_ref_idx")]

    def __str__(self) -> str:
        return f"receipt {self.outcome} for {self.tool_call_id}"


class RunMessage(models.Model):
    """A remote agent's conversation history (issue 27): the messages its framework keeps
    (model requests and answers, tool results), appended by the lease holder and read back
    to rebuild them on resume. NOT part of the record: no event, no hash chain, nothing the
    engine decides from; the steps, calls and receipts are the truth (DESIGN §2)."""

    run = models.ForeignKey(Run, on_delete=models.CASCADE, related_name="messages")
    seq = models.PositiveIntegerField()  # 1, 2, ... per run
    message = models.JSONField()
    size = models.PositiveIntegerField()  # bytes of the message's JSON, for the per-run cap
    digest = models.CharField(max_length=64)  # a retried append is recognised by it
    written_by = models.CharField(max_length=200)
    incarnation = models.PositiveBigIntegerField()
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["run", "seq"]
        constraints = [
            models.UniqueConstraint(fields=["run", "seq"], name="runmessage_run_seq_uniq")
        ]

    def __str__(self) -> str:
        return f"message {self.seq} of {self.run_id}"


class Signal(models.Model):
    """A named message to a run (``runs.waits.run_signal``). Kept until a wait for its name
    consumes it: one that arrives before the wait begins is not lost. Consumed once, in the
    same commit that completes the wait step."""

    run = models.ForeignKey(Run, on_delete=models.CASCADE, related_name="signals")
    name = models.CharField(max_length=100)
    payload = models.JSONField(null=True, blank=True)
    # the sender's retry key: a second signal with the same key is the same signal
    idempotency_key = models.CharField(max_length=200, blank=True)
    sent_by = models.CharField(max_length=200)
    channel = models.CharField(max_length=20, choices=Channel.choices)
    received_at = models.DateTimeField(auto_now_add=True)
    consumed_at = models.DateTimeField(null=True, blank=True)
    consumed_by_step = models.OneToOneField(
        Step, null=True, blank=True, on_delete=models.SET_NULL, related_name="consumed_signal"
    )

    class Meta:
        ordering = ["run", "received_at", "id"]
        constraints = [
            models.UniqueConstraint(
                fields=["run", "idempotency_key"],
                name="signal_run_key_uniq",
                condition=~Q(idempotency_key=""),
            )
        ]
        indexes = [
            models.Index(
                fields=["run", "name", "id"],
                name="signal_unconsumed_idx",
                condition=Q(consumed_at__isnull=True),
            )
        ]

    def __str__(self) -> str:
        return f"signal {self.name} to {self.run_id}"


class Question(models.Model):
    """A question an agent asked people (the ``AskQuestion`` wait). The first valid answer
    wins (``runs.waits.question_answer``); unanswered at ``expires_at``, the agent gets the
    default."""

    class Status(models.TextChoices):
        OPEN = "open"
        ANSWERED = "answered"
        EXPIRED = "expired"
        CANCELLED = "cancelled"

    run = models.ForeignKey(Run, on_delete=models.CASCADE, related_name="questions")
    step = models.OneToOneField(Step, on_delete=models.CASCADE, related_name="question")
    text = models.TextField()
    # null: free text; otherwise the answer must be one of these
    choices = models.JSONField(null=True, blank=True)
    group = models.CharField(max_length=150)
    status = models.CharField(max_length=20, choices=Status.choices, default=Status.OPEN)
    asked_at = models.DateTimeField(auto_now_add=True)
    expires_at = models.DateTimeField()
    default = models.JSONField(null=True, blank=True)
    answer = models.JSONField(null=True, blank=True)
    answered_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.PROTECT, related_name="+"
    )
    channel = models.CharField(max_length=20, choices=Channel.choices, blank=True)
    answered_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-asked_at"]
        indexes = [
            models.Index(
                fields=["group", "expires_at"],
                name="question_open_idx",
                condition=Q(status="open"),
            )
        ]

    def __str__(self) -> str:
        return f"question {self.id} ({self.status})"


class QuestionLink(models.Model):
    """One emailed link to answer a question: a random token (only its sha256 is stored) for
    one person of the question's group. Single-use; it expires with the question
    (``runs.notify``)."""

    question = models.ForeignKey(Question, on_delete=models.CASCADE, related_name="links")
    recipient = models.ForeignKey(
        settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="+"
    )
    token_hash = models.CharField(max_length=64, unique=True)
    created_at = models.DateTimeField(auto_now_add=True)
    # when the mail server accepted the email carrying it (runs.notify.recorded). A hint for
    # people: what sends and resends the email is its outbox row (runs.outbox), which a
    # sweeper sends if the asking process died first; the same link, not a new one
    mailed_at = models.DateTimeField(null=True, blank=True)
    used_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["created_at"]
        indexes = [
            models.Index(
                fields=["created_at"],
                name="questionlink_unmailed_idx",
                condition=Q(mailed_at__isnull=True),
            )
        ]

    def __str__(self) -> str:
        return f"link for {self.recipient_id} on question {self.question_id}"


class AppendOnlyError(Exception):
    pass


class RunEventQuerySet(models.QuerySet):
    # The instance guard below does not cover bulk paths: QuerySet.update() and a fast
    # QuerySet.delete() issue SQL without calling save()/delete() (admin bulk actions,
    # a shell one-liner), so the queryset refuses them too.
    def update(self, **kwargs):
        raise AppendOnlyError("run events are append-only")

    def delete(self):
        raise AppendOnlyError("run events are append-only")


class RunEvent(models.Model):
    """Append-only: appended only through ``runs.record.checkpoint.checkpoint``."""

    Channel = Channel

    # no index of its own: event_run_seq_uniq (run, seq) serves lookups by run
    run = models.ForeignKey(Run, on_delete=models.PROTECT, related_name="events", db_index=False)
    seq = models.PositiveBigIntegerField()
    # Set by checkpoint() and covered by the event's hash, so the stored value must be the
    # hashed one: auto_now_add would replace it at insert and no chain would verify.
    created_at = models.DateTimeField(default=timezone.now, editable=False)
    type = models.CharField(max_length=50)
    actor = models.CharField(max_length=200)
    channel = models.CharField(max_length=20, choices=Channel.choices)
    incarnation = models.PositiveBigIntegerField(null=True, blank=True)
    payload = models.JSONField(default=dict, blank=True)
    trace_id = models.CharField(max_length=32, blank=True)
    span_id = models.CharField(max_length=16, blank=True)
    payload_digest = models.CharField(max_length=64)
    prev_hash = models.CharField(max_length=64)
    hash = models.CharField(max_length=64)
    # The run's creation time, copied at insert (on PostgreSQL from the run row the
    # checkpoint's statement updates). PostgreSQL partitions the events by it, a month per
    # partition (runs 0031), so retention drops a month of runs' events as one table; there
    # it is part of the primary key (id, run_created_at) and of event_run_seq_uniq
    # (run, seq, run_created_at), as partitioning requires. Not hashed: it is the run's.
    run_created_at = models.DateTimeField(editable=False)

    objects = RunEventQuerySet.as_manager()

    class Meta:
        ordering = ["run", "seq"]
        # on PostgreSQL the database's constraint also holds run_created_at (runs 0031): the
        # same rule, as the run fixes it
        constraints = [models.UniqueConstraint(fields=["run", "seq"], name="event_run_seq_uniq")]
        indexes = [
            models.Index(fields=["type", "-created_at"], name="event_type_created_idx"),
            models.Index(fields=["-created_at"], name="event_created_idx"),
        ]

    def __str__(self) -> str:
        return f"{self.run_id}#{self.seq} {self.type}"

    # Integrity guard (CONVENTIONS §3): history is never rewritten through the ORM.
    def save(self, *args, **kwargs):
        if not self._state.adding:
            raise AppendOnlyError("run events are append-only")
        super().save(*args, **kwargs)

    def delete(self, *args, **kwargs):
        raise AppendOnlyError("run events are append-only")


class Worker(models.Model):
    """A worker identity (``runworker --name``), held exclusively while its process lives."""

    class Health(models.TextChoices):
        STARTING = "starting"
        HEALTHY = "healthy"
        FROZEN = "frozen"
        STOPPED = "stopped"

    name = models.CharField(max_length=200, primary_key=True)
    host = models.CharField(max_length=200)
    pid = models.PositiveIntegerField()
    boot_id = models.UUIDField(default=uuid.uuid4)
    started_at = models.DateTimeField()
    heartbeat_at = models.DateTimeField()
    last_task_at = models.DateTimeField(null=True, blank=True)
    health = models.CharField(max_length=20, choices=Health.choices, default=Health.STARTING)
    detail = models.TextField(blank=True)
    # what this process's code can drive (``Registry.serves``): agent versions and tool
    # fingerprints, so a run it cannot serve goes to a worker that can (rolling deploys)
    serves = models.JSONField(default=dict, blank=True)

    class Meta:
        ordering = ["name"]

    def __str__(self) -> str:
        return f"worker {self.name} ({self.health})"


class ApiToken(models.Model):
    """A bearer token for agents and service accounts. Only a hash is stored; the raw token
    is shown once, at creation. It acts as its principal, with the principal's groups."""

    name = models.CharField(max_length=100, unique=True)
    prefix = models.CharField(max_length=12, db_index=True)  # shown in lists to tell tokens apart
    token_hash = models.CharField(max_length=64, unique=True)
    principal = models.ForeignKey(
        settings.AUTH_USER_MODEL, on_delete=models.PROTECT, related_name="api_tokens"
    )
    created_by = models.CharField(max_length=200, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)
    expires_at = models.DateTimeField(null=True, blank=True)
    revoked_at = models.DateTimeField(null=True, blank=True)
    last_used_at = models.DateTimeField(null=True, blank=True)
    # optional callback receiving approval.decided, run.needs_attention, run.lease_expired,
    # run.finished; signed with HMAC-SHA256 using webhook_secret
    webhook_url = models.URLField(blank=True)
    webhook_secret = models.CharField(max_length=64, blank=True)

    class Meta:
        ordering = ["name"]

    def __str__(self) -> str:
        return f"token {self.name} ({self.prefix}…)"


class WebhookDelivery(models.Model):
    """One webhook event to one token's callback, retried with backoff by the workers."""

    class Status(models.TextChoices):
        PENDING = "pending"
        DELIVERED = "delivered"
        FAILED = "failed"

    token = models.ForeignKey(ApiToken, on_delete=models.CASCADE, related_name="deliveries")
    run = models.ForeignKey(Run, null=True, blank=True, on_delete=models.CASCADE, related_name="+")
    event_type = models.CharField(max_length=50)
    payload = models.JSONField(default=dict)
    status = models.CharField(max_length=20, choices=Status.choices, default=Status.PENDING)
    attempts = models.PositiveIntegerField(default=0)
    next_attempt_at = models.DateTimeField(null=True, blank=True)
    last_status_code = models.PositiveIntegerField(null=True, blank=True)
    last_error = models.TextField(blank=True)
    created_at = models.DateTimeField(auto_now_add=True)
    delivered_at = models.DateTimeField(null=True, blank=True)
    # set by the claim (runs.outbox): only its holder may record a failed attempt, and the
    # pre-send check refuses a drainer whose claim was taken over
    claim_token = models.CharField(max_length=64, blank=True)

    class Meta:
        ordering = ["-created_at"]
        verbose_name_plural = "webhook deliveries"
        indexes = [
            models.Index(
                fields=["next_attempt_at"], name="webhook_due_idx", condition=Q(status="pending")
            )
        ]

    def __str__(self) -> str:
        return f"{self.event_type} → {self.token_id} ({self.status})"


class OutboxMessage(models.Model):
    """One email to one address (DESIGN §9 "Messages are part of the record", ``runs.outbox``).

    Written in the transaction whose state change calls for it, so a committed approval
    request, reminder, question or alert always has its message and a rolled-back one never
    does. Workers and the sweeper send it outside any transaction: claimed by a conditional
    UPDATE that sets ``claim_token`` and moves ``next_attempt_at`` out of other drainers'
    reach, checked again just before the send, marked sent after it. ``message_id`` is the
    email's Message-ID header, the same on every attempt: a retry after a send that was never
    marked (a crash, a pause) is recognisable as the same message."""

    class Status(models.TextChoices):
        PENDING = "pending"
        SENT = "sent"
        # gave up after OUTBOX_MAX_ATTEMPTS: shown on the dashboard and in /metrics
        FAILED = "failed"
        # no longer wanted when its turn came (the approval was decided, the question closed)
        CANCELLED = "cancelled"

    message_id = models.CharField(max_length=200, unique=True)
    # what it is about; the renderer registered for it builds the email (runs.outbox)
    kind = models.CharField(max_length=50)
    run = models.ForeignKey(Run, null=True, blank=True, on_delete=models.CASCADE, related_name="+")
    recipient = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.CASCADE, related_name="+"
    )
    to_address = models.CharField(max_length=254)
    # what the renderer needs (ids, the seed of the link's token: never the token itself)
    payload = models.JSONField(default=dict)
    status = models.CharField(max_length=20, choices=Status.choices, default=Status.PENDING)
    attempts = models.PositiveIntegerField(default=0)
    # due when null or past; a claim sets it to the claim's expiry
    next_attempt_at = models.DateTimeField(null=True, blank=True)
    claim_token = models.CharField(max_length=64, blank=True)
    last_error = models.TextField(blank=True)
    created_at = models.DateTimeField(auto_now_add=True)
    sent_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-created_at"]
        indexes = [
            models.Index(
                fields=["next_attempt_at"], name="outbox_due_idx", condition=Q(status="pending")
            ),
            models.Index(fields=["kind", "status"], name="outbox_kind_status_idx"),
        ]

    def __str__(self) -> str:
        return f"{self.kind} to {self.to_address} ({self.status})"


class IdempotentRequest(models.Model):
    """``POST /api/v1/runs/`` with an ``Idempotency-Key``: the same key and body return the
    same run; the same key with another body is refused."""

    principal = models.ForeignKey(
        settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="+"
    )
    key = models.CharField(max_length=200)
    request_digest = models.CharField(max_length=64)
    run = models.ForeignKey(Run, on_delete=models.CASCADE, related_name="+")
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["principal", "key"], name="idempotent_request_uniq")
        ]

    def __str__(self) -> str:
        return f"{self.key} → {self.run_id}"


class AgentManifest(models.Model):
    """A **remote** agent's manifest, registered through ``PUT /api/v1/agents/{name}/``.

    Hosted agents live in code (``runs.registry``); remote agents live here, so every web
    and worker process sees the same version. ``tools`` is a list of tool declarations
    (name, version, argument schema, sensitive fields, effect, approval policy, timeout).
    """

    name = models.CharField(max_length=100, primary_key=True)
    version = models.CharField(max_length=50)
    input_schema = models.JSONField(default=dict, blank=True)
    tools = models.JSONField(default=list, blank=True)
    # version -> list of state migration descriptions (remote agents migrate their own state)
    migrations = models.JSONField(default=dict, blank=True)
    # The principal whose API tokens may lease and drive this agent's runs (with the agent
    # role's permission): named by an admin, never by the agent. None: nobody drives them.
    owner = models.ForeignKey(
        settings.AUTH_USER_MODEL,
        null=True,
        blank=True,
        on_delete=models.SET_NULL,
        related_name="owned_agents",
    )
    # the groups the agent's runs may ask questions (and so email free text) to
    question_groups = models.JSONField(default=list, blank=True)
    registered_by = models.CharField(max_length=200)
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["name"]

    def __str__(self) -> str:
        return f"remote agent {self.name}@{self.version}"


class AuditEntryQuerySet(models.QuerySet):
    def update(self, **kwargs):
        raise AppendOnlyError("audit entries are append-only")

    def delete(self):
        raise AppendOnlyError("audit entries are append-only")


class AuditEntry(models.Model):
    """An action outside any run (DESIGN §2): API token created or revoked, a remote agent's
    manifest registered or changed, a user's roles changed, sign-ins and failed sign-ins.

    Append-only like ``RunEvent`` (ORM guard here, a PostgreSQL trigger in the migration),
    and chained: ``hash`` covers the fields, ``payload_digest`` and the previous entry's hash.
    """

    id = models.BigAutoField(primary_key=True)
    created_at = models.DateTimeField(default=timezone.now, editable=False)
    action = models.CharField(max_length=60)
    actor = models.CharField(max_length=200)
    channel = models.CharField(max_length=20, choices=Channel.choices)
    ip_address = models.GenericIPAddressField(null=True, blank=True)
    user_agent = models.TextField(blank=True)
    object_type = models.CharField(max_length=60, blank=True)
    object_id = models.CharField(max_length=200, blank=True)
    before = models.JSONField(null=True, blank=True)
    after = models.JSONField(null=True, blank=True)
    payload_digest = models.CharField(max_length=64)
    prev_hash = models.CharField(max_length=64)
    hash = models.CharField(max_length=64, unique=True)

    objects = AuditEntryQuerySet.as_manager()

    class Meta:
        ordering = ["-id"]
        verbose_name_plural = "audit entries"
        indexes = [
            models.Index(fields=["action", "-created_at"], name="audit_action_created_idx"),
            models.Index(fields=["actor", "-created_at"], name="audit_actor_created_idx"),
            models.Index(fields=["-created_at"], name="audit_created_idx"),
        ]

    def __str__(self) -> str:
        return f"{self.action} by {self.actor} at {self.created_at:%Y-%m-%d %H:%M:%S}"

    def save(self, *args, **kwargs):
        if not self._state.adding:
            raise AppendOnlyError("audit entries are append-only")
        super().save(*args, **kwargs)

    def delete(self, *args, **kwargs):
        raise AppendOnlyError("audit entries are append-only")


class VerifiedChain(models.Model):
    """How far ``audit_verify`` has verified a run's event chain: every event up to ``seq``
    hashed, linked and found intact, the one at ``seq`` with ``hash``. The next incremental
    check starts there (``runs.audit.run_chains``); ``audit_verify --full`` ignores it.

    Written only by ``audit_verify``. Not a proof on its own: whoever can rewrite events (the
    tables' owner, with the append-only triggers disabled) can rewrite this too, which is why
    ``--full`` exists (docs/audit.md)."""

    run = models.OneToOneField(
        Run, primary_key=True, on_delete=models.CASCADE, related_name="verified_chain"
    )
    seq = models.PositiveBigIntegerField()
    hash = models.CharField(max_length=64)
    verified_at = models.DateTimeField()

    def __str__(self) -> str:
        return f"{self.run_id} verified up to event {self.seq}"


class ArchivedChain(models.Model):
    """A run whose events up to ``seq`` were exported by ``retention`` (docs/operations.md,
    "Retention"): the export's file names and digests, and the chain's head at ``seq`` — where
    the events still stored for the run (if any) must start. ``dropped_at``: when those events
    were removed from the table (they live on only in the export)."""

    run = models.OneToOneField(
        Run, primary_key=True, on_delete=models.PROTECT, related_name="archived_chain"
    )
    # the first day of the month the run was created in (UTC): what retention goes by
    month = models.DateField()
    seq = models.PositiveBigIntegerField()
    hash = models.CharField(max_length=64)
    events = models.PositiveBigIntegerField()
    # the run's smallest and largest event id then: ``audit_verify --expect-head`` counts the
    # dropped events a head recorded earlier had seen
    first_event_id = models.BigIntegerField(null=True)
    last_event_id = models.BigIntegerField(null=True)
    export = models.CharField(max_length=300)
    export_digest = models.CharField(max_length=64)
    archived_at = models.DateTimeField()
    dropped_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        indexes = [models.Index(fields=["month"], name="archivedchain_month_idx")]

    def __str__(self) -> str:
        return f"{self.run_id} archived up to event {self.seq}"


class Alert(models.Model):
    """One operator alert per cause (a run entering ``needs_attention``, a worker that
    stopped heartbeating): emailed and sent to webhooks once, however often pages refresh."""

    class Kind(models.TextChoices):
        RUN_NEEDS_ATTENTION = "run_needs_attention"
        WORKER_STOPPED = "worker_stopped"
        NO_LIVE_WORKER = "no_live_worker"
        # a spend cap's scope used 80 % of its limit, or all of it (runs.spend)
        SPEND_CAP = "spend_cap"

    # e.g. "run_needs_attention:<run id>:<event seq>" or "worker_stopped:<name>:<boot id>"
    cause = models.CharField(max_length=300, unique=True)
    kind = models.CharField(max_length=30, choices=Kind.choices)
    run = models.ForeignKey(Run, null=True, blank=True, on_delete=models.CASCADE, related_name="+")
    worker_name = models.CharField(max_length=200, blank=True)
    detail = models.TextField(blank=True)
    created_at = models.DateTimeField(auto_now_add=True)
    notified_at = models.DateTimeField(null=True, blank=True)
    resolved_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-created_at"]
        indexes = [
            models.Index(
                fields=["created_at"], name="alert_unnotified_idx", condition=Q(notified_at=None)
            )
        ]

    def __str__(self) -> str:
        return f"alert {self.cause}"


# --- flow control (docs/agents.md, "Limits"): per-tool limits shared by every worker ------------


class ToolLimit(models.Model):
    """An operator's limit on a tool, set at run time (audited): it replaces what the tool
    declares (``Tool.limits``) until it is removed. Read by every process from an in-process
    copy refreshed when the set of rows changes (``runs.flow``)."""

    tool_name = models.CharField(max_length=200, unique=True)
    max_in_flight = models.PositiveIntegerField(null=True, blank=True)
    # ``rate`` calls per ``per_seconds`` (1: a second, 60: a minute), with a ``burst``
    rate = models.FloatField(null=True, blank=True)
    per_seconds = models.FloatField(default=1.0)
    burst = models.PositiveIntegerField(null=True, blank=True)
    # one limit per value of this argument (e.g. a merchant account); "" for one limit
    key_argument = models.CharField(max_length=100, blank=True)
    set_by = models.CharField(max_length=200, blank=True)
    reason = models.TextField(blank=True)
    updated_at = models.DateTimeField(auto_now=True)

    def __str__(self) -> str:
        return f"limit on {self.tool_name}"


class ToolCapacity(models.Model):
    """One row per limited tool (and argument value): every dispatch of that tool locks it in
    its ``dispatching`` transaction, so workers on any number of machines share one limit.
    ``tat`` is the rate limiter's state (GCRA: the theoretical arrival time of the next
    call); ``grants`` counts dispatches, the clock of the fair share (``ToolShare``)."""

    tool_name = models.CharField(max_length=200)
    limit_key = models.CharField(max_length=200, blank=True)
    tat = models.DateTimeField(null=True, blank=True)
    grants = models.BigIntegerField(default=0)

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["tool_name", "limit_key"], name="toolcapacity_uniq")
        ]

    def __str__(self) -> str:
        return f"capacity of {self.tool_name} {self.limit_key}".strip()


class ToolShare(models.Model):
    """When a principal's call last got a slot of a limited tool (``ToolCapacity.grants``
    then): the waiter whose principal was served longest ago goes first (round robin)."""

    tool_name = models.CharField(max_length=200)
    limit_key = models.CharField(max_length=200, blank=True)
    share = models.CharField(max_length=100, blank=True)
    last_grant = models.BigIntegerField(default=0)

    class Meta:
        constraints = [
            models.UniqueConstraint(
                fields=["tool_name", "limit_key", "share"], name="toolshare_uniq"
            )
        ]

    def __str__(self) -> str:
        return f"share of {self.share or 'system'} on {self.tool_name}"


class ToolWaiter(models.Model):
    """A run waiting for capacity on a tool: ``queued`` with no lease and a late fallback
    ``wake_at``; woken (its ``wake_at`` brought forward) when a slot frees, in fair order."""

    run = models.OneToOneField(Run, on_delete=models.CASCADE, related_name="capacity_wait")
    tool_name = models.CharField(max_length=200)
    limit_key = models.CharField(max_length=200, blank=True)
    # the principal the run acts as ("" for the system): the unit of the fair share
    share = models.CharField(max_length=100, blank=True)
    since = models.DateTimeField(auto_now_add=True)

    class Meta:
        indexes = [models.Index(fields=["tool_name", "limit_key", "id"], name="toolwaiter_line")]

    def __str__(self) -> str:
        return f"run {self.run_id} waiting for {self.tool_name}"


# --- spend and token caps (docs/agents.md, "Spend caps"): by scope and period ----------------


class SpendCap(models.Model):
    """An operator's cap on what runs in a scope may spend (money, tokens, or both), set at
    run time (audited, ``runs.spend``). ``subject``: the agent's name (``agent``), the
    principal's user id or ``*`` for every principal (``principal``, ``principal_day``; a
    principal's own cap replaces ``*``), "" for ``global_day``. Day scopes count per day in
    ``AGENTOPS["SPEND_TIME_ZONE"]``."""

    class Scope(models.TextChoices):
        AGENT = "agent", "per agent"
        PRINCIPAL = "principal", "per principal"
        PRINCIPAL_DAY = "principal_day", "per principal per day"
        GLOBAL_DAY = "global_day", "everything per day"

    scope = models.CharField(max_length=20, choices=Scope.choices)
    subject = models.CharField(max_length=200, blank=True)
    max_cost = models.DecimalField(max_digits=12, decimal_places=6, null=True, blank=True)
    max_tokens = models.PositiveBigIntegerField(null=True, blank=True)
    set_by = models.CharField(max_length=200, blank=True)
    reason = models.TextField(blank=True)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        constraints = [models.UniqueConstraint(fields=["scope", "subject"], name="spendcap_uniq")]

    def __str__(self) -> str:
        return f"spend cap {self.scope} {self.subject}".strip()


class SpendCounter(models.Model):
    """What one scope spent in one period (``period``: "" for all time, the day's ISO date
    for day scopes): settled usage, what calls in flight have reserved, and operators'
    top-ups of that period. Every reservation and settlement of a run in the scope locks this
    row (in the dispatching or deciding transaction), so concurrent calls share one cap."""

    scope = models.CharField(max_length=20, choices=SpendCap.Scope.choices)
    subject = models.CharField(max_length=200, blank=True)
    period = models.CharField(max_length=10, blank=True)
    cost_used = models.DecimalField(max_digits=14, decimal_places=6, default=0)
    tokens_used = models.BigIntegerField(default=0)
    cost_reserved = models.DecimalField(max_digits=14, decimal_places=6, default=0)
    tokens_reserved = models.BigIntegerField(default=0)
    cost_added = models.DecimalField(max_digits=14, decimal_places=6, default=0)
    tokens_added = models.BigIntegerField(default=0)
    # the limit (cap + top-ups, "cost/tokens") at which the 80 % alert was raised
    warned_at = models.CharField(max_length=100, blank=True)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["scope", "subject", "period"], name="spendcounter_uniq")
        ]

    def __str__(self) -> str:
        return f"spend of {self.scope} {self.subject} {self.period}".strip()


class SpendReservation(models.Model):
    """A model or tool call's declared maximum, reserved before it is made and charged
    until its real usage is known: ``held`` while the call is in flight, ``settled`` with
    the real usage (the provider's answer, the receipt, or an operator), ``cut_off`` when a
    crash cut the model request off before its decision was saved — charged at its maximum
    until an operator settles it."""

    class Kind(models.TextChoices):
        MODEL = "model"
        TOOL = "tool"

    class State(models.TextChoices):
        HELD = "held"
        SETTLED = "settled"
        CUT_OFF = "cut_off"

    run = models.ForeignKey(Run, on_delete=models.CASCADE, related_name="+")
    kind = models.CharField(max_length=10, choices=Kind.choices)
    tool_call = models.ForeignKey(
        "ToolCall", null=True, blank=True, on_delete=models.CASCADE, related_name="+"
    )
    incarnation = models.PositiveBigIntegerField(default=0)
    cost = models.DecimalField(max_digits=12, decimal_places=6, default=0)
    tokens = models.BigIntegerField(default=0)
    state = models.CharField(max_length=10, choices=State.choices, default=State.HELD)
    cost_settled = models.DecimalField(max_digits=12, decimal_places=6, null=True, blank=True)
    tokens_settled = models.BigIntegerField(null=True, blank=True)
    # the SpendCounter ids the reservation is counted in ([] for a dry run, or no cap)
    counters = models.JSONField(default=list, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)
    settled_at = models.DateTimeField(null=True, blank=True)
    settled_by = models.CharField(max_length=200, blank=True)

    class Meta:
        indexes = [
            models.Index(
                fields=["run", "kind"],
                name="spendres_open_idx",
                condition=~Q(state="settled"),
            ),
            models.Index(fields=["tool_call"], name="spendres_call_idx"),
        ]

    def __str__(self) -> str:
        return f"{self.kind} reservation {self.id} of run {self.run_id} ({self.state})"


class SpendStop(models.Model):
    """A run a cap stopped (``needs_attention``, ``budget_exhausted``), and which scope's
    counter: an operator's top-up of that scope resumes it."""

    run = models.OneToOneField(Run, on_delete=models.CASCADE, related_name="spend_stop")
    counter = models.ForeignKey(SpendCounter, on_delete=models.CASCADE, related_name="stops")
    since = models.DateTimeField(auto_now_add=True)

    def __str__(self) -> str:
        return f"run {self.run_id} stopped by {self.counter}"


class ConfigGeneration(models.Model):
    """A token that changes in the same commit as a configuration the workers keep in-process
    (``runs.record.configcache``): ``principals`` (users' names and group memberships, group
    names) and ``policies`` (approval policy versions). Set by database triggers (migrations
    ``runs.0030`` and ``approvals.0015``), so a change made through the Django admin,
    ``user.groups.add()`` or raw SQL moves it as surely as one made by a service. Random, not
    a counter: a transaction rolled back never leaves a value a later change will repeat."""

    name = models.CharField(max_length=50, primary_key=True)
    token = models.CharField(max_length=40)

    def __str__(self) -> str:
        return f"{self.name} generation {self.token}"

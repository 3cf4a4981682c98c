from __future__ import annotations

from django.apps import AppConfig


class RunsConfig(AppConfig):
    name = "runs"
    verbose_name = "Runs"

    def ready(self) -> None:
        # check --deploy: the base URL of emailed links (runs/checks.py)
        from runs import checks  # noqa: F401

        # sign-ins, lockouts and unlocks go to the audit log (issues 8, 17)
        from runs.audit.accounts import connect_signals

        connect_signals()

        # a sign-in starts the idle clock (runs.middleware.IdleSessionMiddleware)
        from django.contrib.auth.signals import user_logged_in

        from runs.middleware import session_mark_active

        user_logged_in.connect(session_mark_active, dispatch_uid="agentops.session.active")

        # operators are emailed once per alert cause (runs.alerts); checked by the sweeper
        from runs import alerts
        from runs.sweeper import register_sweep_hook

        alerts.install()
        register_sweep_hook(alerts.alerts_sweep)

        # every email and webhook is an outbox row (runs.outbox): sent after the commit that
        # wrote it by that process, and by every worker's sweeper whatever it did not send
        from runs import notify, outbox

        notify.install()
        register_sweep_hook(outbox.outbox_drain_due)

        # flow control: runs waiting for capacity on a limited tool are woken in fair order
        # when a slot frees without anyone noticing (a landing deadline passed, a remote
        # receipt, a lost wake-up): runs/flow.py
        from runs import flow, metrics

        register_sweep_hook(flow.sweep_waiters)
        metrics.register_collector(flow.collect_metrics)

        # spend caps: spend by scope in /metrics (runs/spend.py)
        from runs import spend

        metrics.register_collector(spend.collect_metrics)

        # remote agents: the registry resolves manifests; expired remote leases are swept.
        # webhooks: deliveries written with their events, sent by the sweeper (issue 6)
        from runs import remote, webhooks

        remote.install()
        webhooks.install()

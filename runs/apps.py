from django.apps import AppConfig


class RunsConfig(AppConfig):
    name = "runs"
    verbose_name = "Runs"

    def ready(self) -> None:
        # sign-ins, lockouts and unlocks go to the audit log (issues 8, 17)
        from runs.audit import connect_signals

        connect_signals()

        # a sign-in starts the idle clock (runs.middleware.IdleSessionMiddleware)
        from django.contrib.auth.signals import user_logged_in

        from runs.middleware import session_mark_active

        user_logged_in.connect(session_mark_active, dispatch_uid="agentops.session.active")

        # operators are emailed once per alert cause (runs.alerts); checked by the sweeper
        from runs.alerts import alerts_sweep
        from runs.sweeper import register_sweep_hook

        register_sweep_hook(alerts_sweep)

        # question emails a dead process never sent are sent with fresh links (runs.notify)
        from runs.notify import question_emails_resend_due

        register_sweep_hook(question_emails_resend_due)

        # remote agents: the registry resolves manifests; expired remote leases are swept.
        # webhooks: deliveries written with their events, sent by the sweeper (issue 6)
        from runs import remote, webhooks

        remote.install()
        webhooks.install()

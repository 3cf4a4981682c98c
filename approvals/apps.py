from django.apps import AppConfig


class ApprovalsConfig(AppConfig):
    name = "approvals"
    verbose_name = "Approvals"

    def ready(self) -> None:
        # runs never imports approvals: the engine asks the gate this app registers
        from approvals.gate import ApprovalsGate
        from runs.gate import register_gate

        register_gate(ApprovalsGate())

        # approval emails go through the outbox of runs (runs.outbox): how they look
        from approvals import notify

        notify.install()

        from approvals.services import approvals_expire_due, approvals_remind_due
        from runs.sweeper import register_sweep_hook

        register_sweep_hook(approvals_expire_due)
        register_sweep_hook(approvals_remind_due)

        # the console dashboard's "needs me" list shows approvals about to expire
        from approvals.selectors import approvals_expiring_soon
        from runs.selectors import register_attention_source

        register_attention_source(approvals_expiring_soon)

        # /metrics: approvals pending, overdue and settled (runs/metrics.py)
        from approvals.metrics import collect_approvals
        from runs.metrics import register_collector

        register_collector(collect_approvals)

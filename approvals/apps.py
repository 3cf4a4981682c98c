from __future__ import annotations

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

        # "Needs you" (runs.needs_you) lists the approvals the signed-in person may decide
        from approvals.selectors import approvals_needing_me
        from runs.needs_you import register_needs_you_source

        register_needs_you_source(approvals_needing_me)

        # /metrics: approvals pending, overdue and settled (runs/metrics.py)
        from approvals.metrics import collect_approvals
        from runs.metrics import register_collector

        register_collector(collect_approvals)

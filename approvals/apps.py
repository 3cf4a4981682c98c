from django.apps import AppConfig


class ApprovalsConfig(AppConfig):
    name = "approvals"
    verbose_name = "Approvals"

    def ready(self) -> None:
        # runs never imports approvals: the engine asks the gate this app registers
        from approvals.gate import ApprovalsGate
        from runs.gate import register_gate

        register_gate(ApprovalsGate())

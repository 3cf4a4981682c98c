"""Roles (contract: Django groups) and the permissions each holds."""

from __future__ import annotations

ROLE_PERMISSIONS: dict[str, list[str]] = {
    "viewer": ["runs.view_run", "runs.view_step", "runs.view_toolcall", "runs.view_runevent"],
    "operator": [
        "runs.view_run",
        "runs.view_step",
        "runs.view_toolcall",
        "runs.view_runevent",
        "runs.start_run",
        "runs.operate_run",
        "runs.resolve_toolcall",
        "approvals.view_approval",
    ],
    "approver": [
        "runs.view_run",
        "runs.view_toolcall",
        "approvals.view_approval",
        "approvals.decide_approval",
    ],
    # reads everything (the admin site is theirs), changes nothing (approvals 0004)
    "auditor": [
        "runs.view_run",
        "runs.view_step",
        "runs.view_toolcall",
        "runs.view_toolreceipt",
        "runs.view_runevent",
        "runs.view_signal",
        "runs.view_question",
        "runs.view_questionlink",
        "runs.view_worker",
        "runs.view_apitoken",
        "runs.view_webhookdelivery",
        "runs.view_outboxmessage",
        "runs.view_idempotentrequest",
        "runs.view_agentmanifest",
        "runs.view_auditentry",
        "runs.view_alert",
        # flow control's state (runs.flow) and remote agents' history metadata
        "runs.view_toollimit",
        "runs.view_toolcapacity",
        "runs.view_toolshare",
        "runs.view_toolwaiter",
        "runs.view_runmessage",
        # the MCP gateway's map of client keys to calls, and sessions to runs (agentops.mcp)
        "mcp.view_gatewaysession",
        "mcp.view_gatewaycall",
        # how far audit_verify has verified each chain; what retention exported and dropped
        "runs.view_verifiedchain",
        "runs.view_archivedchain",
        # spend caps (runs.spend): caps, what each scope spent, reservations, stopped runs
        "runs.view_spendcap",
        "runs.view_spendcounter",
        "runs.view_spendreservation",
        "runs.view_spendstop",
        # the generations that tell workers a configuration changed (runs.record.configcache)
        "runs.view_configgeneration",
        "approvals.view_approval",
        "approvals.view_approvaldecision",
        "approvals.view_approvallink",
        "approvals.view_approvalpolicy",
        "approvals.view_approvalpolicyversion",
        "auth.view_user",
        "auth.view_group",
    ],
    # service accounts that drive remote agents (DESIGN §9, contract name): lease, drive and
    # read the runs of the agents whose manifests name them owner (runs.actors) — nothing an
    # operator does. Anything more is an admin's explicit, audited grant of another role.
    "agent": ["runs.drive_remote_run"],
    "admin": [
        "runs.view_run",
        "runs.start_run",
        "runs.operate_run",
        "runs.resolve_toolcall",
        "approvals.view_approval",
        "approvals.decide_approval",
        # approval policies as data (docs/approvals.md, "Policies"): list, diff, draft,
        # simulate and publish — publishing takes a second admin
        "approvals.view_approvalpolicy",
        "approvals.view_approvalpolicyversion",
        "approvals.manage_approvalpolicy",
    ],
}


def sync_roles(apps) -> None:
    """Create the role groups with their permissions (idempotent)."""
    from django.contrib.auth.management import create_permissions

    for app_config in apps.get_app_configs():
        app_config.models_module = True
        create_permissions(app_config, apps=apps, verbosity=0)
        app_config.models_module = None
    Group = apps.get_model("auth", "Group")
    Permission = apps.get_model("auth", "Permission")
    for role, perms in ROLE_PERMISSIONS.items():
        group, _ = Group.objects.get_or_create(name=role)
        for perm in perms:
            app_label, codename = perm.split(".")
            permission = Permission.objects.filter(
                content_type__app_label=app_label, codename=codename
            ).first()
            # A model created by a later migration has no permission yet at this point of
            # the migration history: the migration that comes after it grants it.
            if permission is not None:
                group.permissions.add(permission)

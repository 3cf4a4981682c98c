"""A third-party agent app, as a team outside this repository writes one (docs/agents.md,
"Registering"): installed through ``AGENTOPS_APPS``, never by editing settings.py."""

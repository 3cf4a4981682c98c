"""Test settings: the real settings with short leases and poll intervals, so crash and
recovery tests finish in seconds. Worker subprocesses started by tests use this module too."""

from __future__ import annotations

import os

_FAST = {
    "AGENTOPS_LEASE_TTL": "3",
    "AGENTOPS_SWEEP_INTERVAL": "0.2",
    "AGENTOPS_REQUEUE_AFTER": "1.5",
    "AGENTOPS_RECONCILE_BACKOFF": "0.2",
    "AGENTOPS_RECONCILE_MAX_ATTEMPTS": "3",
    "AGENTOPS_REDISPATCH_MARGIN": "0.5",
    "AGENTOPS_WORKER_STALE_AFTER": "3",
    "AGENTOPS_CANARY_INTERVAL": "1",
    "AGENTOPS_FROZEN_AFTER": "8",
    "AGENTOPS_Q_POLL": "0.05",
    "AGENTOPS_Q_TIMEOUT": "60",
    "AGENTOPS_Q_RETRY": "90",
    "AGENTOPS_SLICE_SECONDS": "20",
    # the sweeper emails no operator alerts unless a test turns them on (tests/runs/test_alerts.py)
    "AGENTOPS_ALERT_INTERVAL": "0",
    # the API suite and Schemathesis send far more than a client would in a minute
    "AGENTOPS_API_USER_RATE": "100000/min",
    "AGENTOPS_API_ANON_RATE": "100000/min",
    # webhook receivers in tests listen on loopback
    "AGENTOPS_WEBHOOK_ALLOWED_NETWORKS": "127.0.0.0/8,::1/128",
    "AGENTOPS_WEBHOOK_BACKOFF": "0.2",
    # the suite's sandbox runs non-deduplicating without deadline checks (tests/conftest.py):
    # the demo tools declare that its downstream honours nothing
    "AGENTOPS_SANDBOX_HONOURS": "",
}
for _key, _value in _FAST.items():
    os.environ.setdefault(_key, _value)
# the real settings default to production (DEBUG=0: SECRET_KEY, ALLOWED_HOSTS, https only);
# the suite talks plain http to testserver and 127.0.0.1
os.environ.setdefault("DEBUG", "1")

from agentops.settings import *  # noqa: E402,F403

PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]
# worker processes started by a harness with its own SMTP server (chaos, the outbox's
# crash tests) are told so through EMAIL_BACKEND; the suite itself keeps mail in memory
EMAIL_BACKEND = os.environ.get("EMAIL_BACKEND", "django.core.mail.backends.locmem.EmailBackend")
# Throttle counters per test process: the database cache (the production default, tested in
# tests/api/test_throttling.py) would add its queries to every API test's pinned count.
CACHES = {"default": {"BACKEND": "django.core.cache.backends.locmem.LocMemCache"}}

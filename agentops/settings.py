"""agentops settings: everything comes from the environment through typed helpers.

Production is the default (``DEBUG=0``: ``SECRET_KEY`` and ``ALLOWED_HOSTS`` required, https
only); ``DEBUG=1`` is development (`make run`). The database defaults to an embedded SQLite
file in WAL mode under ``var/``; set ``DATABASE_URL`` for PostgreSQL (psycopg 3).
docs/operations.md lists every variable.
"""

from __future__ import annotations

import importlib.util
import ipaddress
import warnings
from datetime import timedelta
from pathlib import Path
from typing import Any

import dj_database_url
from django.core.exceptions import ImproperlyConfigured

from agentops.env import env_bool, env_decimal, env_float, env_int, env_list, env_str

BASE_DIR = Path(__file__).resolve().parent.parent
VAR_DIR = Path(env_str("AGENTOPS_VAR_DIR", str(BASE_DIR / "var")))

# Production is the default: DEBUG is off unless asked for (`make run`, `make chaos` and the
# test settings set DEBUG=1), and then SECRET_KEY and ALLOWED_HOSTS must be given.
DEBUG = env_bool("DEBUG", False)
SECRET_KEY = env_str("SECRET_KEY", "dev-insecure-secret-key-change-me" if DEBUG else None)
ALLOWED_HOSTS = env_list("ALLOWED_HOSTS", ["127.0.0.1", "localhost", "testserver"] if DEBUG else [])
if not DEBUG and not ALLOWED_HOSTS:
    raise ImproperlyConfigured(
        "environment variable ALLOWED_HOSTS is required when DEBUG=0 "
        "(comma-separated host names this server answers, e.g. agentops.example.com)"
    )

INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "django.contrib.humanize",
    "django_htmx",
    "template_partials",
    "rest_framework",
    "drf_spectacular",
    "drf_spectacular_sidecar",
    "django_q",
    "csp",
    "axes",
    "runs",
    "approvals",
    "agentops.demo",
    # make bench (docs/benchmarks.md): its command; its agents are registered only when it runs
    "agentops.bench",
    # after the demo: the gateway exposes the tools registered before it (docs/mcp.md)
    "agentops.mcp",
]

# Third-party agent apps (docs/agents.md, "Registering"): Django apps whose AppConfig.ready()
# registers their tools and agents, named without editing this file. Every web process and
# worker must be started with the same list.
AGENTOPS_APPS = env_list("AGENTOPS_APPS", [])
for _app in AGENTOPS_APPS:
    if _app in INSTALLED_APPS:
        raise ImproperlyConfigured(f"AGENTOPS_APPS names {_app}, which is already installed")
    try:
        _found = importlib.util.find_spec(_app)
    except (ImportError, ValueError):
        _found = None
    if _found is None:
        raise ImproperlyConfigured(
            f"AGENTOPS_APPS names {_app}, which cannot be imported "
            "(installed in this virtualenv, or on PYTHONPATH?)"
        )
INSTALLED_APPS += AGENTOPS_APPS

MIDDLEWARE = [
    # /healthz, /healthz/workers, /metrics: answered before Host validation (probes and
    # scrapers address machines by IP), each guarding itself (runs/health.py)
    "runs.health.ProbeMiddleware",
    # a NUL character in a path or query string: 400, before any view or database sees it
    "runs.middleware.RefuseNulMiddleware",
    "django.middleware.security.SecurityMiddleware",
    # serves static/ (htmx, css) from the app server too, so `gunicorn` needs no web server
    # in front for them
    "whitenoise.middleware.WhiteNoiseMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
    "csp.middleware.CSPMiddleware",
    "django_htmx.middleware.HtmxMiddleware",
    # times on pages in the operator's timezone (the `tz` cookie set by static/js/timezone.js)
    "runs.middleware.OperatorTimezoneMiddleware",
    # a polling page whose session expired goes to the sign-in page as a whole
    "runs.middleware.HtmxLoginRedirectMiddleware",
    # a session idle for AGENTOPS_SESSION_IDLE_TIMEOUT is signed out
    "runs.middleware.IdleSessionMiddleware",
    # last, as django-axes asks: turns a locked-out sign-in into its 429 page
    "axes.middleware.AxesMiddleware",
]

# --- security (docs/operations.md, "Security settings") ------------------------------------
# Off in development (plain http on 127.0.0.1); on by default in production. Each can be
# overridden, e.g. SECURE_SSL_REDIRECT=0 when a proxy in front already redirects.
SECURE_SSL_REDIRECT = env_bool("SECURE_SSL_REDIRECT", not DEBUG)
SESSION_COOKIE_SECURE = env_bool("SESSION_COOKIE_SECURE", not DEBUG)
CSRF_COOKIE_SECURE = env_bool("CSRF_COOKIE_SECURE", not DEBUG)
SECURE_HSTS_SECONDS = env_int("SECURE_HSTS_SECONDS", 0 if DEBUG else 31_536_000)
SECURE_HSTS_INCLUDE_SUBDOMAINS = env_bool("SECURE_HSTS_INCLUDE_SUBDOMAINS", not DEBUG)
SECURE_HSTS_PRELOAD = env_bool("SECURE_HSTS_PRELOAD", not DEBUG)
SECURE_CONTENT_TYPE_NOSNIFF = True
SECURE_REFERRER_POLICY = "same-origin"
SECURE_CROSS_ORIGIN_OPENER_POLICY = "same-origin"
X_FRAME_OPTIONS = "DENY"
SESSION_COOKIE_HTTPONLY = True
# TLS usually ends at a proxy or load balancer: name the header it sets (e.g.
# X-Forwarded-Proto) so Django knows the original request was https. Only set this when the
# proxy always sets or strips that header, or clients could claim https themselves.
_proxy_ssl_header = env_str("SECURE_PROXY_SSL_HEADER", "")
SECURE_PROXY_SSL_HEADER = (
    ("HTTP_" + _proxy_ssl_header.upper().replace("-", "_"), "https") if _proxy_ssl_header else None
)
CSRF_TRUSTED_ORIGINS = env_list("CSRF_TRUSTED_ORIGINS", [])

# Content-Security-Policy (django-csp): no inline script or style anywhere. Pages load
# their JavaScript from static/js/, htmx is told not to inject its indicator <style> nor to
# copy style attributes when it swaps (htmx-config meta in base.html), and Swagger UI loads
# its init script from a URL.
_SELF, _NONE = "'self'", "'none'"
CONTENT_SECURITY_POLICY = {
    "DIRECTIVES": {
        "default-src": [_SELF],
        "script-src": [_SELF],
        "style-src": [_SELF],
        # data: for the favicon placeholder and Swagger UI's inline SVG icons
        "img-src": [_SELF, "data:"],
        "font-src": [_SELF],
        "connect-src": [_SELF],
        "object-src": [_NONE],
        "base-uri": [_SELF],
        "form-action": [_SELF],
        "frame-ancestors": [_NONE],
    }
}

ROOT_URLCONF = "agentops.urls"
WSGI_APPLICATION = "agentops.wsgi.application"

TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [BASE_DIR / "templates"],
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ],
        },
    },
]

# --- database ---------------------------------------------------------------------------
_default_sqlite = VAR_DIR / "agentops.sqlite3"
DATABASE_URL = env_str("DATABASE_URL", f"sqlite:///{_default_sqlite}")
try:
    _db = dj_database_url.parse(DATABASE_URL)
except Exception as exc:  # dj-database-url raises several types for a bad URL
    raise ImproperlyConfigured(f"DATABASE_URL is not a usable database URL: {exc}") from None

# What sits between us and PostgreSQL. A transaction pooler (PgBouncer's
# pool_mode = transaction) hands each transaction whichever server connection is free, so
# nothing may outlive a transaction on a connection: the engine's own locks are
# transaction-scoped or rows with leases already (docs/operations.md), and what Django and
# psycopg keep per session is turned off below. Ignored on SQLite.
PG_POOLER = env_str("AGENTOPS_PG_POOLER", "none").strip().lower() or "none"
if PG_POOLER not in ("none", "session", "transaction"):
    raise ImproperlyConfigured(
        f"AGENTOPS_PG_POOLER={PG_POOLER!r}: use none, session or transaction "
        "(statement pooling cannot run the engine's transactions of several statements)"
    )
if _db["ENGINE"] == "django.db.backends.sqlite3":
    Path(_db["NAME"]).parent.mkdir(parents=True, exist_ok=True)
    _db["OPTIONS"] = {
        # WAL lets readers run beside the single writer; IMMEDIATE takes the write lock at
        # BEGIN so two writers queue on the busy timeout instead of failing mid-transaction.
        "init_command": "PRAGMA journal_mode=WAL; PRAGMA synchronous=NORMAL;",
        "transaction_mode": "IMMEDIATE",
        "timeout": env_float("AGENTOPS_SQLITE_TIMEOUT", 30.0),
    }
    # A file (not :memory:) so worker subprocesses started by tests see the same data.
    _db["TEST"] = {"NAME": f"{_db['NAME']}.test"}
    _db["CONN_MAX_AGE"] = 0
elif _db["ENGINE"] == "django.db.backends.postgresql":
    _db["CONN_MAX_AGE"] = env_int("CONN_MAX_AGE", 60)
    _db["CONN_HEALTH_CHECKS"] = True
    _db["TEST"] = {"NAME": env_str("AGENTOPS_TEST_DATABASE", f"test_{_db['NAME']}")}
    # Server-side parameters, and statements run twice on a connection prepared: PostgreSQL
    # plans the engine's few statements once, and psycopg does not quote values into SQL
    # (together about a third of the CPU of a step: docs/benchmarks.md).
    if env_bool("AGENTOPS_PG_SERVER_BINDING", True):
        # added to the URL's own options (sslmode, application_name, ...), not instead
        _db["OPTIONS"] = {
            **_db.get("OPTIONS", {}),
            "server_side_binding": True,
            "prepare_threshold": 2,
        }
    if PG_POOLER == "transaction":
        # A named prepared statement lives in one server session: behind a transaction pooler
        # the next transaction runs on another and fails with `prepared statement "_pg3_N"
        # does not exist`. Parameters still travel apart from the SQL (an unnamed statement,
        # parsed and run in one round trip); only the plan cache across statements is lost.
        _db["OPTIONS"] = {**_db.get("OPTIONS", {}), "prepare_threshold": None}
        # QuerySet.iterator() would DECLARE a cursor WITH HOLD outside a transaction: a
        # session object the next fetch cannot find on another server connection
        _db["DISABLE_SERVER_SIDE_CURSORS"] = True
        if "assume_role" in _db.get("OPTIONS", {}):
            raise ImproperlyConfigured(
                "assume_role runs SET ROLE once per connection, which a transaction pooler "
                "does not keep: connect as that role instead (AGENTOPS_PG_POOLER=transaction)"
            )
else:
    raise ImproperlyConfigured(f"DATABASE_URL uses an unsupported engine: {_db['ENGINE']}")
DATABASES = {"default": _db}
IS_SQLITE = _db["ENGINE"] == "django.db.backends.sqlite3"

DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

AUTH_PASSWORD_VALIDATORS = [
    {"NAME": "django.contrib.auth.password_validation.UserAttributeSimilarityValidator"},
    {
        "NAME": "django.contrib.auth.password_validation.MinimumLengthValidator",
        "OPTIONS": {"min_length": env_int("AGENTOPS_PASSWORD_MIN_LENGTH", 12)},
    },
    {"NAME": "django.contrib.auth.password_validation.CommonPasswordValidator"},
    {"NAME": "django.contrib.auth.password_validation.NumericPasswordValidator"},
]

# --- sign-in (docs/operations.md "Sign-in and sessions") ----------------------------------
# django-axes checks every sign-in (console, admin) before the password: after
# AGENTOPS_SIGN_IN_FAILURE_LIMIT failures of one username from one address, each less than
# AGENTOPS_SIGN_IN_LOCKOUT seconds after the one before, that username is refused from that
# address until AGENTOPS_SIGN_IN_LOCKOUT seconds after the last failure. The username and the
# address together: a stranger typing an approver's name elsewhere locks out only themselves.
AUTHENTICATION_BACKENDS = [
    "axes.backends.AxesStandaloneBackend",
    "django.contrib.auth.backends.ModelBackend",
]
AXES_FAILURE_LIMIT = env_int("AGENTOPS_SIGN_IN_FAILURE_LIMIT", 5)
AXES_COOLOFF_TIME = timedelta(seconds=env_float("AGENTOPS_SIGN_IN_LOCKOUT", 15 * 60.0))
AXES_LOCKOUT_PARAMETERS = [["username", "ip_address"]]
# the connection's address, as the audit log records it (X-Forwarded-For is the client's
# choice); an IPv6 address counts as its /64
AXES_CLIENT_IP_CALLABLE = "runs.audit.accounts.sign_in_client_address"
AXES_RESET_ON_SUCCESS = True
# sign-ins are audit entries already (runs.audit.accounts); lockouts and unlocks too
AXES_DISABLE_ACCESS_LOG = True
# its admin would delete attempts unaudited: runs.admin registers an auditing one
AXES_ENABLE_ADMIN = False
AXES_LOCKOUT_TEMPLATE = "registration/locked_out.html"
AXES_VERBOSE = False
if AXES_FAILURE_LIMIT < 1 or AXES_COOLOFF_TIME.total_seconds() <= 0:
    raise ImproperlyConfigured(
        "AGENTOPS_SIGN_IN_FAILURE_LIMIT and AGENTOPS_SIGN_IN_LOCKOUT must be positive"
    )

# A session idle this many seconds is over (runs.middleware.IdleSessionMiddleware): the
# cookie and the stored session expire then too. Background refreshes of a page left open
# (htmx GETs) are not activity.
SESSION_IDLE_TIMEOUT = env_int("AGENTOPS_SESSION_IDLE_TIMEOUT", 8 * 3600)
if SESSION_IDLE_TIMEOUT < 60:
    raise ImproperlyConfigured("AGENTOPS_SESSION_IDLE_TIMEOUT must be at least 60 seconds")
SESSION_COOKIE_AGE = SESSION_IDLE_TIMEOUT

# Shared by every process (API throttle counters): a table in the database, created by a
# migration (runs 0019), so gunicorn's processes and machines count together.
CACHES = {
    "default": {
        "BACKEND": "django.core.cache.backends.db.DatabaseCache",
        "LOCATION": "agentops_cache",
    }
}

LANGUAGE_CODE = "en-us"
TIME_ZONE = "UTC"
USE_I18N = True
USE_TZ = True

STATIC_URL = "static/"
STATICFILES_DIRS = [BASE_DIR / "static"]
STATIC_ROOT = VAR_DIR / "static"
# serve straight from static/ without a `collectstatic` step (a handful of small files);
# STATIC_ROOT then usually does not exist, which WhiteNoise would warn about at every start
WHITENOISE_USE_FINDERS = True
warnings.filterwarnings("ignore", message="No directory at: ", category=UserWarning)

LOGIN_URL = "login"
LOGIN_REDIRECT_URL = "/"
LOGOUT_REDIRECT_URL = "login"

EMAIL_BACKEND = env_str("EMAIL_BACKEND", "django.core.mail.backends.console.EmailBackend")
EMAIL_HOST = env_str("EMAIL_HOST", "localhost")
EMAIL_PORT = env_int("EMAIL_PORT", 25)
DEFAULT_FROM_EMAIL = env_str("DEFAULT_FROM_EMAIL", "agentops@localhost")

REST_FRAMEWORK = {
    # Bearer first: its WWW-Authenticate header makes an unauthenticated request a 401
    "DEFAULT_AUTHENTICATION_CLASSES": [
        "runs.authentication.BearerTokenAuthentication",
        "rest_framework.authentication.SessionAuthentication",
    ],
    "DEFAULT_PERMISSION_CLASSES": ["rest_framework.permissions.IsAuthenticated"],
    "DEFAULT_RENDERER_CLASSES": ["rest_framework.renderers.JSONRenderer"],
    "DEFAULT_PARSER_CLASSES": ["runs.api_parsers.LimitedJSONParser"],
    "DEFAULT_METADATA_CLASS": "runs.api_parsers.PlainMetadata",
    "DEFAULT_SCHEMA_CLASS": "drf_spectacular.openapi.AutoSchema",
    "TEST_REQUEST_DEFAULT_FORMAT": "json",
    # every error is {"code", "detail"} (+ "fields" for validation_error)
    "EXCEPTION_HANDLER": "runs.api.common.exception_handler",
    # Authenticated requests, per user, after the permission check (DRF's order). Requests
    # with no credentials or bad ones are counted per address before that, at authentication
    # (runs.throttling): DRF would refuse them with 401/403 before any throttle ran.
    "DEFAULT_THROTTLE_CLASSES": ["rest_framework.throttling.UserRateThrottle"],
    "DEFAULT_THROTTLE_RATES": {
        "anon": env_str("AGENTOPS_API_ANON_RATE", "120/min"),
        "user": env_str("AGENTOPS_API_USER_RATE", "1200/min"),
    },
    # the address is the connection's: with NUM_PROXIES unset DRF would take X-Forwarded-For,
    # which any client sets to a new value per request. Behind N proxies that set it, N.
    "NUM_PROXIES": env_int("AGENTOPS_API_NUM_PROXIES", 0),
}

SPECTACULAR_SETTINGS = {
    "TITLE": "agentops API",
    "DESCRIPTION": (
        "Run long-running AI agents durably, with people in the loop. Authenticate with "
        "`Authorization: Bearer <token>` (`manage.py create_api_token`). Every error is "
        '`{"code", "detail"}`, plus `"fields"` for `validation_error`.'
    ),
    "VERSION": "1",
    "SERVE_INCLUDE_SCHEMA": False,
    "SERVE_PERMISSIONS": ["rest_framework.permissions.AllowAny"],
    "SERVE_AUTHENTICATION": [],
    # Swagger UI from the sidecar package: served by this app, no CDN
    "SWAGGER_UI_DIST": "SIDECAR",
    "SWAGGER_UI_FAVICON_HREF": "SIDECAR",
    "REDOC_DIST": "SIDECAR",
    "COMPONENT_SPLIT_REQUEST": True,
    # OpenAPI links (create → read → act) and closed manifest schemas: runs/api/openapi.py
    "POSTPROCESSING_HOOKS": [
        "drf_spectacular.hooks.postprocess_schema_enums",
        "runs.api.openapi.add_links",
    ],
    "ENUM_NAME_OVERRIDES": {
        "RunStatusEnum": "runs.models.Run.Status",
        "ToolCallStatusEnum": "runs.models.ToolCall.Status",
        "ApprovalStatusEnum": "approvals.models.Approval.Status",
        "WaitKindEnum": "runs.remote.WAIT_KINDS",
    },
}

# --- django-q2: only the wake-up signal; the run table decides what runs ---------------
Q_CLUSTER = {
    "name": "agentops",
    "orm": "default",
    # the ORM broker, but a lost connection does not stop the pusher for 10 s (runs/broker.py)
    "broker_class": "runs.broker.OrmBroker",
    "workers": env_int("AGENTOPS_Q_WORKERS", 2),
    # A task advances one slice (bounded by AGENTOPS_SLICE_SECONDS); timeout < retry so the
    # broker does not hand a still-running slice to a second worker. If it ever does, the
    # second copy finds the lease taken and exits.
    "timeout": env_int("AGENTOPS_Q_TIMEOUT", 300),
    "retry": env_int("AGENTOPS_Q_RETRY", 360),
    "save_limit": -1,
    "ack_failures": True,
    "max_attempts": 1,
    "poll": env_float("AGENTOPS_Q_POLL", 0.2),
    "catch_up": False,
    "sync": env_bool("AGENTOPS_Q_SYNC", False),
    "label": "Tasks",
}

if Q_CLUSTER["timeout"] >= Q_CLUSTER["retry"]:
    # the broker would hand a still-running slice to a second worker
    raise ImproperlyConfigured("AGENTOPS_Q_TIMEOUT must be smaller than AGENTOPS_Q_RETRY")

# --- the engine ---------------------------------------------------------------------------
# values of several types, read by name (typed where they are read)
AGENTOPS: dict[str, Any] = {
    # lease length; renewed at every checkpoint and by a heartbeat during tool calls
    "LEASE_TTL": env_float("AGENTOPS_LEASE_TTL", 30.0),
    # how often the sweeper looks for expired leases, due timers and orphaned runs
    "SWEEP_INTERVAL": env_float("AGENTOPS_SWEEP_INTERVAL", 1.0),
    # an enqueued run not claimed within this long is enqueued again (duplicates are harmless)
    "REQUEUE_AFTER": env_float("AGENTOPS_REQUEUE_AFTER", 10.0),
    # rolling deploys: a run this worker's code cannot serve, handed to a live worker that
    # can, is claimable again after this many seconds (runs/engine/serving.py)
    "HANDOFF_DELAY": env_float("AGENTOPS_HANDOFF_DELAY", 1.0),
    # one task advances at most this many steps / seconds, then yields to other runs
    "SLICE_STEPS": env_int("AGENTOPS_SLICE_STEPS", 50),
    "SLICE_SECONDS": env_float("AGENTOPS_SLICE_SECONDS", 60.0),
    "MAX_RECOVERIES": env_int("AGENTOPS_MAX_RECOVERIES", 10),
    # reconciliation lookups that fail or cannot decide: retried with backoff, then a person
    "RECONCILE_MAX_ATTEMPTS": env_int("AGENTOPS_RECONCILE_MAX_ATTEMPTS", 5),
    "RECONCILE_BACKOFF": env_float("AGENTOPS_RECONCILE_BACKOFF", 1.0),
    # issue 18: JSON that comes in (API bodies, console and approval forms, commands) is
    # refused past these limits, or with a NUL character, with a 400 and a code
    # (json_too_deep, json_too_large, nul_byte); a tool's or lookup's answer is stored with
    # the offending parts replaced instead (runs.jsonlimits)
    "JSON_MAX_DEPTH": env_int("AGENTOPS_JSON_MAX_DEPTH", 32),
    "JSON_MAX_BYTES": env_int("AGENTOPS_JSON_MAX_BYTES", 1024 * 1024),
    "JSON_MAX_STRING": env_int("AGENTOPS_JSON_MAX_STRING", 64 * 1024),
    # issue 27: a remote run's conversation history (non-authoritative, runs.remote.history):
    # at most this many bytes of JSON per message, and in all per run
    "HISTORY_MAX_MESSAGE_BYTES": env_int("AGENTOPS_HISTORY_MAX_MESSAGE_BYTES", 256 * 1024),
    "HISTORY_MAX_BYTES": env_int("AGENTOPS_HISTORY_MAX_BYTES", 16 * 1024 * 1024),
    # long polls (?wait=N on a run or an approval) held at once per API token in one web
    # process; more are answered at once (runs.api.longpoll)
    "LONG_POLLS_PER_TOKEN": env_int("AGENTOPS_LONG_POLLS_PER_TOKEN", 2),
    # ... and of all tokens together: past that a long poll is refused (429 long_polls_busy),
    # so waiting clients leave the other half of a process's threads to everyone else
    "LONG_POLLS_PER_PROCESS": env_int(
        "AGENTOPS_LONG_POLLS_PER_PROCESS", max(1, env_int("GUNICORN_THREADS", 4) // 2)
    ),
    # DESIGN §9: a dispatched request may leave only within this many seconds of its
    # ``dispatching`` commit (and never after that commit's lease expiry): its send deadline
    "SEND_WINDOW": env_float("AGENTOPS_SEND_WINDOW", 2.0),
    # the landing deadline is send deadline + the tool's total timeout + this margin (clock
    # skew between us and the downstream, network delay): a call that is reliably absent is
    # sent again only after a lookup that started after it
    "REDISPATCH_MARGIN": env_float("AGENTOPS_REDISPATCH_MARGIN", 2.0),
    # read tools are retried this many times before the step fails
    "READ_MAX_ATTEMPTS": env_int("AGENTOPS_READ_MAX_ATTEMPTS", 3),
    # liveness canary: a worker whose cluster ran no task for FROZEN_AFTER while work waits
    # is frozen. Longer than a slice, so one long task is not mistaken for a frozen cluster.
    "CANARY_INTERVAL": env_float("AGENTOPS_CANARY_INTERVAL", 5.0),
    "FROZEN_AFTER": env_float("AGENTOPS_FROZEN_AFTER", 90.0),
    # a worker identity whose heartbeat is older than this is dead
    "WORKER_STALE_AFTER": env_float("AGENTOPS_WORKER_STALE_AFTER", 15.0),
    # runworker retries an unreachable database this long at start-up, then exits with 1
    "STARTUP_DB_WAIT": env_float("AGENTOPS_STARTUP_DB_WAIT", 30.0),
    "DEFAULT_MAX_STEPS": env_int("AGENTOPS_DEFAULT_MAX_STEPS", 100),
    "SANDBOX_URL": env_str("AGENTOPS_SANDBOX_URL", "http://127.0.0.1:8765"),
    # what the sandbox honours, as the demo tools declare it (agentops/demo/tools.py,
    # docs/agents.md "What the downstream honours"): ``key`` (it deduplicates refunds by
    # idempotency key), ``deadline`` (it refuses writes received after their send deadline);
    # empty: nothing. The default matches the sandbox's default mode (``--mode dedupe``,
    # deadline checking off); set it to match how the sandbox runs.
    "SANDBOX_HONOURS": env_list("AGENTOPS_SANDBOX_HONOURS", ["key"]),
    # ``person``: the refund tool sends an absent lookup to an operator instead of sending again
    "SANDBOX_RESEND": env_str("AGENTOPS_SANDBOX_RESEND", "auto"),
    # the demo tools' total timeout (seconds) for one call, connection set-up included
    "SANDBOX_TIMEOUT": env_float("AGENTOPS_SANDBOX_TIMEOUT", 5.0),
    # absolute links in emails (approval and question links, alerts) start with this: the
    # address people open the console at. `rundemo --port N` sets it for its processes; in
    # production it has no default, and `check --deploy` requires it when email is sent
    # (runs/checks.py)
    "BASE_URL": env_str("AGENTOPS_BASE_URL", "http://127.0.0.1:8000" if DEBUG else ""),
    # a pending approval's approvers are reminded once, this many seconds before it
    # expires (0: never); only approvals that live longer than this get a reminder
    "APPROVAL_REMINDER_BEFORE": env_float("AGENTOPS_APPROVAL_REMINDER_BEFORE", 3600.0),
    # webhooks (runs.webhooks): callback URLs resolving to private, loopback or link-local
    # addresses are refused unless inside one of these networks (e.g. "127.0.0.0/8")
    "WEBHOOK_ALLOWED_NETWORKS": env_list("AGENTOPS_WEBHOOK_ALLOWED_NETWORKS", []),
    # a failed delivery is retried after BACKOFF * 2^(attempt-1) seconds, MAX_ATTEMPTS in all
    "WEBHOOK_BACKOFF": env_float("AGENTOPS_WEBHOOK_BACKOFF", 5.0),
    "WEBHOOK_MAX_ATTEMPTS": env_int("AGENTOPS_WEBHOOK_MAX_ATTEMPTS", 8),
    # the outbox (runs.outbox, DESIGN §9): emails and webhook deliveries. A claim keeps other
    # drainers off a message this long; one SMTP/HTTP send may take SEND_TIMEOUT of it, and
    # must start before the claim has less than that left
    "OUTBOX_CLAIM_SECONDS": env_float("AGENTOPS_OUTBOX_CLAIM_SECONDS", 30.0),
    "OUTBOX_SEND_TIMEOUT": env_float("AGENTOPS_OUTBOX_SEND_TIMEOUT", 10.0),
    # a failed email is retried after BACKOFF * 2^(attempt-1) seconds (at most an hour),
    # MAX_ATTEMPTS in all; then it is ``failed``: on the dashboard and in /metrics
    "OUTBOX_BACKOFF": env_float("AGENTOPS_OUTBOX_BACKOFF", 5.0),
    "OUTBOX_MAX_ATTEMPTS": env_int("AGENTOPS_OUTBOX_MAX_ATTEMPTS", 8),
    # retention (``manage.py prune``, docs/audit.md): terminal runs that ended longer ago
    # than this have their bulky data emptied (events are kept); archived first to this
    # directory when it is set
    "PRUNE_TERMINAL_AFTER": env_str("AGENTOPS_PRUNE_TERMINAL_AFTER", "90d"),
    "PRUNE_ARCHIVE_DIR": env_str("AGENTOPS_PRUNE_ARCHIVE_DIR", ""),
    # how often (seconds) each worker's sweeper looks for alert causes (runs.alerts); each
    # cause is emailed to operators once, however often it is seen
    "ALERT_INTERVAL": env_float("AGENTOPS_ALERT_INTERVAL", 5.0),
    # spend caps (runs.spend, docs/operations.md "Spend caps"): the time zone whose days the
    # per-day caps count (an IANA name), and the share of a cap at which operators are alerted
    "SPEND_TIME_ZONE": env_str("AGENTOPS_SPEND_TIME_ZONE", "UTC"),
    "SPEND_WARN_AT": env_float("AGENTOPS_SPEND_WARN_AT", 0.8),
    # the dashboard's "needs me" list shows pending approvals expiring within this many seconds
}
try:
    import zoneinfo as _zoneinfo

    _zoneinfo.ZoneInfo(AGENTOPS["SPEND_TIME_ZONE"])
except (ValueError, _zoneinfo.ZoneInfoNotFoundError) as _exc:
    raise ImproperlyConfigured(
        f"AGENTOPS_SPEND_TIME_ZONE={AGENTOPS['SPEND_TIME_ZONE']!r} is not a time zone"
    ) from _exc
if not 0 < AGENTOPS["SPEND_WARN_AT"] < 1:
    raise ImproperlyConfigured("AGENTOPS_SPEND_WARN_AT must be between 0 and 1 (0.8: 80 %)")
if AGENTOPS["OUTBOX_CLAIM_SECONDS"] <= AGENTOPS["OUTBOX_SEND_TIMEOUT"] + 1:
    # the pre-send check would never pass: no message would ever be sent
    raise ImproperlyConfigured(
        "AGENTOPS_OUTBOX_CLAIM_SECONDS must exceed AGENTOPS_OUTBOX_SEND_TIMEOUT + 1"
    )
_unknown_honours = set(AGENTOPS["SANDBOX_HONOURS"]) - {"key", "deadline"}
if _unknown_honours:
    raise ImproperlyConfigured(
        f"AGENTOPS_SANDBOX_HONOURS: unknown {sorted(_unknown_honours)[0]!r} "
        "(expected a comma-separated list of key, deadline; empty for nothing)"
    )
if AGENTOPS["SANDBOX_RESEND"] not in ("auto", "person"):
    raise ImproperlyConfigured(
        f"AGENTOPS_SANDBOX_RESEND={AGENTOPS['SANDBOX_RESEND']!r}: expected auto or person"
    )
if AGENTOPS["SANDBOX_TIMEOUT"] <= 0:
    raise ImproperlyConfigured("AGENTOPS_SANDBOX_TIMEOUT must be a positive number of seconds")

# --- health and metrics (runs/health.py, docs/operations.md "Health and metrics") ---------
# /metrics and /healthz/workers answer a client in ALLOWED_NETWORKS (a request that came
# through a proxy, with X-Forwarded-For or Forwarded, never counts as one) or one presenting
# `Authorization: Bearer <TOKEN>`. Neither set: nobody. /healthz is open (it says ok or not).
AGENTOPS_METRICS = {
    "TOKEN": env_str("AGENTOPS_METRICS_TOKEN", ""),
    "ALLOWED_NETWORKS": env_list("AGENTOPS_METRICS_ALLOWED_NETWORKS", ["127.0.0.0/8", "::1/128"]),
}
try:
    for _network in AGENTOPS_METRICS["ALLOWED_NETWORKS"]:
        ipaddress.ip_network(_network, strict=False)
except ValueError as exc:
    raise ImproperlyConfigured(f"AGENTOPS_METRICS_ALLOWED_NETWORKS: {exc}") from None

# json: one object per line with run id, incarnation, trace id, worker and boundary (for a
# log shipper; the production default); human: a readable line (the development default)
LOG_FORMAT = env_str("LOG_FORMAT", "human" if DEBUG else "json")
if LOG_FORMAT not in ("json", "human"):
    raise ImproperlyConfigured(f"LOG_FORMAT={LOG_FORMAT!r}: use json or human")
# --- LLM-backed agents (runs/llm.py): any OpenAI-compatible Chat Completions API ----------
# --- the MCP gateway (docs/mcp.md): its own ASGI process, `manage.py runmcp` -----------------
AGENTOPS_MCP = {
    "HOST": env_str("AGENTOPS_MCP_HOST", "127.0.0.1"),
    "PORT": env_int("AGENTOPS_MCP_PORT", 8001),
    # how long a tools/call is held waiting for its outcome (an approval, a slow tool) before
    # it answers "pending" with a handle: under common MCP clients' 60 s request timeout
    "HOLD_SECONDS": env_float("AGENTOPS_MCP_HOLD_SECONDS", 55.0),
    # how often a held call reads the record
    "POLL_SECONDS": env_float("AGENTOPS_MCP_POLL_SECONDS", 0.25),
    # a gateway run with no call for this long finishes; the next call starts a new run
    "IDLE_SECONDS": env_float("AGENTOPS_MCP_IDLE_SECONDS", 24 * 3600.0),
    # steps a gateway run may take (each call is one, each wake-up another)
    "MAX_STEPS": env_int("AGENTOPS_MCP_MAX_STEPS", 10_000),
    # the registered tools the gateway offers (empty: all); a tool's allowed_groups still apply
    "TOOLS": env_list("AGENTOPS_MCP_TOOLS", []),
    # tools proxied from upstream MCP servers, with their declared effect class and approval
    # policy (JSON, docs/mcp.md; checked when the apps load); every process must be started
    # with the same value
    "UPSTREAMS": env_str("AGENTOPS_MCP_UPSTREAMS", ""),
    # tools/call requests one gateway process holds at once; past that a call is refused
    # before anything is recorded (gateway_busy, retry_after): each is a connection and a poll
    "MAX_HELD": env_int("AGENTOPS_MCP_MAX_HELD", 200),
    # remote agents whose manifest tools the gateway offers (none by default): a call of one
    # is recorded in a run of that agent and carried out by its own process (docs/mcp.md)
    "REMOTE_AGENTS": env_list("AGENTOPS_MCP_REMOTE_AGENTS", []),
}
if AGENTOPS_MCP["HOLD_SECONDS"] <= 0 or AGENTOPS_MCP["HOLD_SECONDS"] > 55:
    raise ImproperlyConfigured("AGENTOPS_MCP_HOLD_SECONDS must be more than 0 and at most 55")

AGENTOPS_LLM = {
    # e.g. https://api.openai.com/v1; empty: no LLM agent is registered by the demo
    "BASE_URL": env_str("AGENTOPS_LLM_BASE_URL", ""),
    "API_KEY": env_str("AGENTOPS_LLM_API_KEY", ""),
    # pinned on each new run (Run.model_id); changing it never moves a live run
    "MODEL": env_str("AGENTOPS_LLM_MODEL", "gpt-4o-mini"),
    # seconds for one request, and for all attempts of one decision together
    "TIMEOUT": env_float("AGENTOPS_LLM_TIMEOUT", 60.0),
    "DECISION_TIMEOUT": env_float("AGENTOPS_LLM_DECISION_TIMEOUT", 180.0),
    # 429, 5xx, timeouts and connection errors: retried with exponential backoff and jitter
    "MAX_RETRIES": env_int("AGENTOPS_LLM_MAX_RETRIES", 4),
    "BACKOFF": env_float("AGENTOPS_LLM_BACKOFF", 1.0),
    "MAX_BACKOFF": env_float("AGENTOPS_LLM_MAX_BACKOFF", 30.0),
    # still failing after the retries: the run is released and asked again this much later
    "POSTPONE": env_float("AGENTOPS_LLM_POSTPONE", 60.0),
    # prices per million tokens, for the run's cost budget
    "INPUT_PRICE": env_decimal("AGENTOPS_LLM_INPUT_PRICE", "0"),
    "OUTPUT_PRICE": env_decimal("AGENTOPS_LLM_OUTPUT_PRICE", "0"),
    "MAX_OUTPUT_TOKENS": env_int("AGENTOPS_LLM_MAX_OUTPUT_TOKENS", 1024),
    # the most prompt tokens one request is expected to send: with MAX_OUTPUT_TOKENS, the
    # declared maximum a decision reserves against budgets and spend caps before it asks
    # (two requests: the answer and one correction), settled at the model's real usage
    "MAX_PROMPT_TOKENS": env_int("AGENTOPS_LLM_MAX_PROMPT_TOKENS", 16000),
    # steps sent verbatim; older ones are condensed into a summary derived from the record
    "HISTORY_STEPS": env_int("AGENTOPS_LLM_HISTORY_STEPS", 20),
}

LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "filters": {
        "run_context": {"()": "runs.logs.RunContextFilter"},
        # approval and question link tokens never reach a log line (issue 17)
        "redact_links": {"()": "runs.logs.RedactLinkTokens"},
    },
    "formatters": {
        "human": {"()": "runs.logs.HumanFormatter"},
        "json": {"()": "runs.logs.JsonFormatter"},
    },
    "handlers": {
        "console": {
            "class": "logging.StreamHandler",
            "formatter": LOG_FORMAT,
            "filters": ["run_context", "redact_links"],
        }
    },
    "root": {"handlers": ["console"], "level": env_str("LOG_LEVEL", "INFO")},
    "loggers": {
        "django-q": {"level": env_str("Q_LOG_LEVEL", "WARNING")},
        "httpx": {"level": "WARNING"},
    },
}

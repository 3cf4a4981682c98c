"""gunicorn settings for the agentops web process (docs/operations.md, "Deploying").

    gunicorn -c deploy/gunicorn.conf.py agentops.wsgi

Every value can be overridden from the environment (GUNICORN_* below, or gunicorn's own
GUNICORN_CMD_ARGS). Workers only serve pages and the API: runs are advanced by
``manage.py runworker``, so a web worker never does slow work and a short timeout is right.
"""

from __future__ import annotations

import multiprocessing
import os
from pathlib import Path


def _int(name: str, default: int) -> int:
    value = os.environ.get(name, "").strip()
    return int(value) if value else default


bind = os.environ.get("GUNICORN_BIND", f"0.0.0.0:{os.environ.get('PORT', '8000')}")
# requests are short database round trips: two processes per core, a few threads each
workers = _int("GUNICORN_WORKERS", max(2, multiprocessing.cpu_count() * 2))
threads = _int("GUNICORN_THREADS", 4)
worker_class = "gthread"
timeout = _int("GUNICORN_TIMEOUT", 30)
# SIGTERM: finish the requests in flight for this long, then stop (systemd's
# TimeoutStopSec for the web unit is longer than this)
graceful_timeout = _int("GUNICORN_GRACEFUL_TIMEOUT", 25)
keepalive = 5
# recycle workers now and then (a slow leak never becomes an outage); jitter keeps them from
# restarting together
max_requests = _int("GUNICORN_MAX_REQUESTS", 2000)
max_requests_jitter = _int("GUNICORN_MAX_REQUESTS_JITTER", 200)
# not preloaded: each worker opens its own database connections after the fork
preload_app = False
# the heartbeat file lives in memory: a full or slow disk cannot make workers look hung
if Path("/dev/shm").is_dir():
    worker_tmp_dir = "/dev/shm"
# X-Forwarded-* are trusted only from these addresses (the reverse proxy); with Django's
# SECURE_PROXY_SSL_HEADER set the same way, https is recognised behind the proxy
forwarded_allow_ips = os.environ.get("FORWARDED_ALLOW_IPS", "127.0.0.1,::1")
accesslog = os.environ.get("GUNICORN_ACCESS_LOG", "-")
errorlog = "-"
loglevel = os.environ.get("GUNICORN_LOG_LEVEL", "info")
proc_name = "agentops-web"

# gunicorn's own lines (errors, the access log) in the same format as the app's: JSON in
# production, as agentops/settings.py decides from LOG_FORMAT and DEBUG. Both kinds pass
# through runs.logs.RedactLinkTokens: an approval or question link's path is its secret token,
# and the access log would otherwise keep every one (request line, Referer).
_debug = os.environ.get("DEBUG", "0").strip().lower() in {"1", "true", "yes", "on"}
_json = os.environ.get("LOG_FORMAT", "human" if _debug else "json") == "json"
logconfig_dict = {
    "version": 1,
    "disable_existing_loggers": False,
    "root": {"level": "INFO", "handlers": ["console"]},
    "filters": {"redact_links": {"()": "runs.logs.RedactLinkTokens"}},
    "formatters": {
        "json": {"()": "runs.logs.JsonFormatter"},
        # gunicorn's own default layouts
        "access": {"format": "%(message)s"},
        "error": {
            "format": "%(asctime)s [%(process)d] [%(levelname)s] %(message)s",
            "datefmt": "[%Y-%m-%d %H:%M:%S %z]",
        },
    },
    # the names gunicorn's defaults use: the access log to stdout, errors to stderr
    "handlers": {
        "console": {
            "class": "logging.StreamHandler",
            "formatter": "json" if _json else "access",
            "filters": ["redact_links"],
            "stream": "ext://sys.stdout",
        },
        "error_console": {
            "class": "logging.StreamHandler",
            "formatter": "json" if _json else "error",
            "filters": ["redact_links"],
            "stream": "ext://sys.stderr",
        },
    },
    "loggers": {
        "gunicorn.error": {
            "handlers": ["error_console"],
            "level": loglevel.upper(),
            "propagate": False,
        },
        "gunicorn.access": {"handlers": ["console"], "level": "INFO", "propagate": False},
    },
}

"""Probes and the metrics endpoint (docs/operations.md, "Health and metrics").

* ``GET /healthz`` — the web process is up and reaches its database. Open to anyone (it
  tells nothing but ok or not): for load balancers and ``systemd``/container probes.
* ``GET /healthz/workers`` — worker identities with heartbeat ages and health (JSON), and
  503 when no worker is alive or one is frozen: the cluster-level liveness check.
* ``GET /metrics`` — Prometheus text exposition (runs/metrics.py).

The last two name hosts and processes, so they answer only clients in
``AGENTOPS_METRICS_ALLOWED_NETWORKS`` (default loopback) or presenting the bearer token
``AGENTOPS_METRICS_TOKEN``.
"""

from __future__ import annotations

import hmac
import ipaddress
import logging
from typing import Any

from django.conf import settings
from django.db import DatabaseError, connection
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.views.decorators.cache import never_cache
from django.views.decorators.http import require_GET
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4

from runs import metrics
from runs.dbtime import db_now
from runs.models import Worker

log = logging.getLogger(__name__)


def _database_ok() -> tuple[bool, str]:
    try:
        with connection.cursor() as cursor:
            cursor.execute("SELECT 1")
            cursor.fetchone()
    except Exception as exc:  # whatever the driver raises, the answer is "not healthy"
        return False, type(exc).__name__
    return True, "ok"


@require_GET
@never_cache
def healthz(request: HttpRequest) -> JsonResponse:
    ok, detail = _database_ok()
    if not ok:
        log.error("healthz: database unavailable (%s)", detail)
        return JsonResponse({"status": "error", "database": "unavailable"}, status=503)
    return JsonResponse({"status": "ok", "database": "ok"})


def _forwarded(request: HttpRequest) -> bool:
    return "HTTP_X_FORWARDED_FOR" in request.META or "HTTP_FORWARDED" in request.META


def _client_allowed(request: HttpRequest) -> bool:
    conf = settings.AGENTOPS_METRICS
    token = conf["TOKEN"]
    header = request.META.get("HTTP_AUTHORIZATION", "")
    if token and header.startswith("Bearer "):
        return hmac.compare_digest(header[len("Bearer ") :].strip().encode(), token.encode())
    if _forwarded(request):
        # came through a proxy: REMOTE_ADDR is the proxy's (often loopback), not the client's
        return False
    try:
        address = ipaddress.ip_address(request.META.get("REMOTE_ADDR", ""))
    except ValueError:
        return False
    return any(
        address in ipaddress.ip_network(network, strict=False)
        for network in conf["ALLOWED_NETWORKS"]
    )


def _refused() -> HttpResponse:
    response = JsonResponse(
        {
            "code": "forbidden",
            "detail": "metrics are served to AGENTOPS_METRICS_ALLOWED_NETWORKS or with "
            "Authorization: Bearer <AGENTOPS_METRICS_TOKEN>",
        },
        status=403,
    )
    response["WWW-Authenticate"] = 'Bearer realm="agentops-metrics"'
    return response


@require_GET
@never_cache
def workers_health(request: HttpRequest) -> HttpResponse:
    if not _client_allowed(request):
        return _refused()
    ok, detail = _database_ok()
    if not ok:
        return JsonResponse({"status": "error", "database": "unavailable"}, status=503)
    now = db_now()
    stale_after = settings.AGENTOPS["WORKER_STALE_AFTER"]
    workers: list[dict[str, Any]] = []
    for worker in Worker.objects.all():
        heartbeat_age = (now - worker.heartbeat_at).total_seconds()
        reference = worker.last_task_at or worker.started_at
        alive = worker.health != Worker.Health.STOPPED and heartbeat_age <= stale_after
        workers.append(
            {
                "name": worker.name,
                "host": worker.host,
                "pid": worker.pid,
                "health": worker.health,
                "alive": alive,
                "heartbeat_age_seconds": round(heartbeat_age, 3),
                "last_task_age_seconds": round((now - reference).total_seconds(), 3),
                "started_at": worker.started_at.isoformat(),
                "detail": worker.detail,
            }
        )
    alive = [w for w in workers if w["alive"]]
    frozen = [w["name"] for w in alive if w["health"] == Worker.Health.FROZEN]
    if not alive:
        status, problem = "error", "no live worker: nothing advances runs"
    elif frozen:
        status, problem = "error", f"frozen: {', '.join(frozen)} (restart them)"
    else:
        status, problem = "ok", ""
    return JsonResponse(
        {
            "status": status,
            "problem": problem,
            "alive": len(alive),
            "stale_after_seconds": stale_after,
            "workers": workers,
        },
        status=200 if status == "ok" else 503,
    )


@require_GET
@never_cache
def metrics_view(request: HttpRequest) -> HttpResponse:
    if not _client_allowed(request):
        return _refused()
    try:
        body = metrics.exposition()
    except DatabaseError as exc:
        # the scrape fails visibly (Prometheus records up == 0), never with a stack trace
        log.error("metrics: database unavailable: %s", exc)
        return JsonResponse({"status": "error", "database": "unavailable"}, status=503)
    # the classic text format, which every Prometheus version (and most agents) reads
    return HttpResponse(body, content_type=CONTENT_TYPE_PLAIN_0_0_4)


PROBES = {"/healthz": healthz, "/healthz/workers": workers_health, "/metrics": metrics_view}


class ProbeMiddleware:
    """Answers the probe paths first, before Django validates the Host header: load
    balancers and Prometheus address a machine by its IP, which is rarely in ALLOWED_HOSTS.
    These views build no URLs from the host and guard themselves (``_client_allowed``)."""

    def __init__(self, get_response: Any) -> None:
        self.get_response = get_response

    def __call__(self, request: HttpRequest) -> HttpResponse:
        view = PROBES.get(request.path_info)
        if view is not None:
            return view(request)
        return self.get_response(request)

from __future__ import annotations

from django.contrib import admin
from django.contrib.auth import views as auth_views
from django.urls import include, path
from django.views import defaults

from agentops import api_urls
from runs import health
from runs.api.common import json_404, json_500

urlpatterns = [
    # probes and the Prometheus endpoint (runs/health.py, docs/operations.md)
    path("healthz", health.healthz, name="healthz"),
    path("healthz/workers", health.workers_health, name="healthz-workers"),
    path("metrics", health.metrics_view, name="metrics"),
    path("admin/", admin.site.urls),
    path("accounts/login/", auth_views.LoginView.as_view(), name="login"),
    path("accounts/logout/", auth_views.LogoutView.as_view(), name="logout"),
    path("api/v1/", include((api_urls.v1, "api"))),
    path("api/", include(api_urls.docs)),
    path("approvals/", include("approvals.urls")),
    path("", include("runs.urls")),
]


def handler404(request, exception):
    # API clients get the API's error shape even for a URL that matches no route
    if request.path.startswith("/api/"):
        return json_404(request, exception)
    return defaults.page_not_found(request, exception)


def handler500(request):
    if request.path.startswith("/api/"):
        return json_500(request)
    return defaults.server_error(request)

"""API throttles that also count requests with no credentials or bad ones (DRF would answer
those 401/403 before any throttle ran), per address, in a cache every process shares."""

from __future__ import annotations

import pytest
from django.core.cache import caches
from django.core.cache.backends.db import DatabaseCache
from django.core.management import call_command
from django.db import connection
from rest_framework.test import APIClient

from runs.throttling import UnauthenticatedRateThrottle
from tests.api.conftest import assert_error, token_for

pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("roles")]

DATABASE_CACHE = {
    "default": {
        "BACKEND": "django.core.cache.backends.db.DatabaseCache",
        "LOCATION": "agentops_cache",
    }
}


@pytest.fixture
def shared_cache(settings, monkeypatch):
    """The production cache (the database table of runs 0019) and a rate of 3 a minute."""
    settings.CACHES = DATABASE_CACHE
    call_command("createcachetable", verbosity=0)
    monkeypatch.setattr(UnauthenticatedRateThrottle, "THROTTLE_RATES", {"anon": "3/min"})
    yield
    caches["default"].clear()


def _get(client: APIClient, address: str = "198.51.100.7", **headers):
    return client.get("/api/v1/runs/", REMOTE_ADDR=address, **headers)


def test_requests_without_credentials_are_throttled_per_address(shared_cache):
    client = APIClient()
    for _ in range(3):
        assert_error(_get(client), 401, "not_authenticated")
    response = _get(client)
    assert_error(response, 429, "throttled")
    assert int(response["Retry-After"]) > 0
    # another address has its own count
    assert_error(_get(client, "203.0.113.9"), 401, "not_authenticated")


def test_bad_tokens_are_throttled_and_a_valid_token_from_the_same_address_is_not(
    shared_cache, operator
):
    guesser = APIClient()
    guesser.credentials(HTTP_AUTHORIZATION="Bearer ao_not-a-real-token")
    for _ in range(3):
        assert_error(_get(guesser), 401, "not_authenticated")
    assert_error(_get(guesser), 429, "throttled")

    agent = APIClient()
    agent.credentials(HTTP_AUTHORIZATION=f"Bearer {token_for(operator)}")
    assert _get(agent).status_code == 200


def test_x_forwarded_for_is_no_way_around_the_count(shared_cache):
    client = APIClient()
    for n in range(3):
        _get(client, HTTP_X_FORWARDED_FOR=f"10.0.0.{n}")
    assert_error(_get(client, HTTP_X_FORWARDED_FOR="10.0.0.99"), 429, "throttled")


def test_the_count_is_in_the_database_where_every_process_reads_it(shared_cache):
    client = APIClient()
    for _ in range(3):
        _get(client)
    # a cache object of its own, as another gunicorn process or machine would have
    other_process = DatabaseCache("agentops_cache", {})
    history = other_process.get("throttle_unauthenticated_198.51.100.7")
    assert len(history) == 3
    with connection.cursor() as cursor:
        cursor.execute("SELECT count(*) FROM agentops_cache")
        assert cursor.fetchone()[0] >= 1


def test_the_health_endpoint_stays_out_of_throttling(shared_cache):
    client = APIClient()
    for _ in range(5):
        assert client.get("/api/v1/health/", REMOTE_ADDR="198.51.100.7").status_code == 200

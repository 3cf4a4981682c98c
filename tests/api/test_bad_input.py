"""Bad input at the edge (issue 18): deep, large or NUL-containing JSON is a 400 with a code,
the same on both databases and for every operation; OPTIONS answers on every route; nothing
is written by a refused request."""

from __future__ import annotations

import json

import pytest
from django.urls import URLPattern, URLResolver, get_resolver

from runs.models import Run

pytestmark = pytest.mark.django_db


def _nested(levels: int) -> str:
    return '{"input": ' + '{"a": ' * levels + "1" + "}" * levels + "}"


def _post(client, url: str, body: str):
    return client.generic("POST", url, body, content_type="application/json")


@pytest.mark.parametrize("levels", [33, 1000, 100_000])
def test_json_nested_too_deep_is_refused_with_a_code(as_operator, levels):
    response = _post(as_operator, "/api/v1/runs/", _nested(levels))

    assert response.status_code == 400
    assert response.json()["code"] == "json_too_deep"
    assert Run.objects.count() == 0


def test_json_as_deep_as_allowed_reaches_validation(as_operator):
    response = _post(as_operator, "/api/v1/runs/", _nested(20))

    # past the JSON rule: what the operation itself says of it
    assert response.json()["code"] != "json_too_deep"


def test_a_nul_character_in_json_is_refused_on_every_database(as_operator):
    body = json.dumps({"agent": "nope", "goal": "refund\u0000", "input": {}})

    response = _post(as_operator, "/api/v1/runs/", body)

    assert response.status_code == 400
    assert response.json()["code"] == "nul_byte"


def test_a_nul_character_in_a_key_is_refused(as_operator):
    response = _post(as_operator, "/api/v1/runs/", json.dumps({"agent": "x", "in\u0000": 1}))

    assert response.json()["code"] == "nul_byte"


def test_a_body_over_the_limit_is_refused(as_operator, settings):
    settings.AGENTOPS = {**settings.AGENTOPS, "JSON_MAX_BYTES": 1000}

    response = _post(as_operator, "/api/v1/runs/", json.dumps({"goal": "x" * 2000}))

    assert response.status_code == 400
    assert response.json()["code"] == "json_too_large"


def test_a_string_over_the_limit_is_refused(as_operator, settings):
    settings.AGENTOPS = {**settings.AGENTOPS, "JSON_MAX_STRING": 100}

    response = _post(as_operator, "/api/v1/runs/", json.dumps({"goal": "x" * 101}))

    assert response.json()["code"] == "json_too_large"


def test_a_nul_character_in_the_path_or_query_is_a_400(as_viewer):
    for url in ("/api/v1/agents/%00/", "/api/v1/runs/?q=%00", "/runs/%00/"):
        response = as_viewer.get(url)
        assert response.status_code == 400, url
    assert as_viewer.get("/api/v1/agents/%00/").json()["code"] == "nul_byte"


def _api_routes() -> list[str]:
    """Every /api/v1/ route with its converters filled in by a plausible value."""
    samples = {"uuid": "00000000-0000-0000-0000-000000000000", "int": "1", "str": "x"}
    found = []

    def walk(patterns, prefix):
        for pattern in patterns:
            route = prefix + str(pattern.pattern)
            if isinstance(pattern, URLResolver):
                walk(pattern.url_patterns, route)
            elif isinstance(pattern, URLPattern) and route.startswith("api/v1/"):
                for kind, value in samples.items():
                    while f"<{kind}:" in route:
                        start = route.index(f"<{kind}:")
                        route = route[:start] + value + route[route.index(">", start) + 1 :]
                found.append("/" + route)

    walk(get_resolver().url_patterns, "")
    return found


def test_every_api_route_answers_options_and_head_without_a_server_error(as_operator):
    routes = _api_routes()
    assert len(routes) > 20

    for url in routes:
        options = as_operator.options(url)
        assert options.status_code in (200, 404, 405), (url, options.status_code)
        if options.status_code == 200:
            assert "methods" in options.json(), url
        head = as_operator.head(url)
        assert head.status_code < 500, (url, head.status_code)

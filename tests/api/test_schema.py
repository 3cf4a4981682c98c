"""The OpenAPI schema describes the API truthfully, the docs are served locally, and
Schemathesis finds no server error and no response that breaks the schema."""

from __future__ import annotations

import os
import re
from collections.abc import Iterator

import pytest
import schemathesis
from django.core.servers.basehttp import WSGIServer
from django.test.testcases import LiveServerThread, _StaticFilesHandler
from rest_framework.test import APIClient

from tests.api.conftest import token_for

pytestmark = pytest.mark.django_db

ENDPOINTS = {
    ("/api/v1/health/", "get"),
    ("/api/v1/agents/", "get"),
    ("/api/v1/runs/", "get"),
    ("/api/v1/runs/", "post"),
    ("/api/v1/runs/{run_id}/", "get"),
    ("/api/v1/runs/{run_id}/events/", "get"),
    ("/api/v1/runs/{run_id}/pause/", "post"),
    ("/api/v1/runs/{run_id}/resume/", "post"),
    ("/api/v1/runs/{run_id}/terminate/", "post"),
    ("/api/v1/runs/{run_id}/budget/", "post"),
    ("/api/v1/runs/{run_id}/fork/", "post"),
    ("/api/v1/runs/{run_id}/promote/", "post"),
    ("/api/v1/runs/{run_id}/retry-recovery/", "post"),
    ("/api/v1/tool-calls/", "get"),
    ("/api/v1/tool-limits/", "get"),
    ("/api/v1/tool-limits/", "post"),
    ("/api/v1/tool-limits/remove/", "post"),
    ("/api/v1/spend-caps/", "get"),
    ("/api/v1/spend-caps/", "post"),
    ("/api/v1/spend-caps/remove/", "post"),
    ("/api/v1/spend-caps/top-up/", "post"),
    ("/api/v1/spend-reservations/", "get"),
    ("/api/v1/spend-reservations/{reservation_id}/settle/", "post"),
    ("/api/v1/tool-calls/{tool_call_id}/resolution/", "post"),
    ("/api/v1/approvals/", "get"),
    ("/api/v1/approvals/{approval_id}/", "get"),
    ("/api/v1/approvals/{approval_id}/decision/", "post"),
    ("/api/v1/policies/", "get"),
    ("/api/v1/policies/", "post"),
    ("/api/v1/policies/simulations/", "post"),
    ("/api/v1/policies/{policy_id}/withdrawal/", "post"),
    ("/api/v1/policy-versions/{version_id}/", "get"),
    ("/api/v1/policy-versions/{version_id}/simulation/", "post"),
    ("/api/v1/policy-versions/{version_id}/publication/", "post"),
    ("/api/v1/questions/{question_id}/answer/", "post"),
    ("/api/v1/agents/{name}/", "get"),
    ("/api/v1/agents/{name}/", "put"),
    ("/api/v1/runs/{run_id}/signals/", "post"),
    ("/api/v1/runs/{run_id}/lease/", "post"),
    ("/api/v1/runs/{run_id}/lease/heartbeat/", "post"),
    ("/api/v1/runs/{run_id}/lease/release/", "post"),
    ("/api/v1/runs/{run_id}/steps/", "post"),
    ("/api/v1/runs/{run_id}/tool-calls/", "post"),
    ("/api/v1/runs/{run_id}/waits/", "post"),
    ("/api/v1/runs/{run_id}/finish/", "post"),
    ("/api/v1/runs/{run_id}/state/", "post"),
    ("/api/v1/runs/{run_id}/messages/", "get"),
    ("/api/v1/runs/{run_id}/messages/", "post"),
    ("/api/v1/tool-calls/{tool_call_id}/dispatch/", "post"),
    ("/api/v1/tool-calls/{tool_call_id}/send-check/", "post"),
    ("/api/v1/tool-calls/{tool_call_id}/lookups/", "post"),
    ("/api/v1/tool-calls/{tool_call_id}/receipt/", "post"),
    ("/api/v1/runs/{run_id}/mcp-calls/", "get"),
    ("/api/v1/agents/{name}/mcp-runs/", "get"),
}


@pytest.fixture
def openapi(db) -> dict:
    response = APIClient().get("/api/schema/", HTTP_ACCEPT="application/vnd.oai.openapi+json")
    assert response.status_code == 200
    return response.json()


def test_schema_lists_every_endpoint(openapi):
    operations = {(path, method) for path, item in openapi["paths"].items() for method in item}
    assert operations == ENDPOINTS


def test_every_authenticated_operation_documents_its_errors(openapi):
    for path, item in openapi["paths"].items():
        for method, operation in item.items():
            if path == "/api/v1/health/":
                continue
            assert {"401", "403", "429"} <= set(operation["responses"]), (path, method)
            error = operation["responses"]["401"]["content"]["application/json"]["schema"]
            assert error == {"$ref": "#/components/schemas/Error"}


def test_schema_declares_bearer_auth(openapi):
    assert openapi["components"]["securitySchemes"]["bearerAuth"]["scheme"] == "bearer"


def test_create_run_documents_idempotency_and_its_error_codes(openapi):
    operation = openapi["paths"]["/api/v1/runs/"]["post"]
    assert "Idempotency-Key" in {p["name"] for p in operation["parameters"]}
    assert {"200", "201", "400", "409"} <= set(operation["responses"])
    assert "idempotency_key_reused" in operation["responses"]["409"]["description"]
    assert "unknown_agent" in operation["responses"]["400"]["description"]


@pytest.mark.django_db
def test_docs_are_served_locally_without_inline_script():
    client = APIClient()
    response = client.get("/api/docs/")

    assert response.status_code == 200
    html = response.content.decode()
    scripts = re.findall(r"<script([^>]*)>(.*?)</script>", html, re.S)
    assert scripts and all('src="' in attrs and not body.strip() for attrs, body in scripts)
    for src in re.findall(r'src="([^"]+)"', html):
        assert not src.startswith("http"), src  # no CDN
    bundle = re.search(r'src="([^"]*swagger-ui-bundle[^"]*)"', html).group(1)
    assert client.get(bundle).status_code == 200


# --- Schemathesis, every phase, against a served instance -----------------------------------

# Every check runs, positive_data_acceptance included. A few operations may refuse a
# schema-valid request with 400 for reasons no request schema can state, because they depend
# on stored data; for those alone 400 is an expected answer (each documents it):
DATA_DEPENDENT_400 = {
    # the agent must exist, and the input must match *that agent's* input schema
    "POST /api/v1/runs/": "unknown_agent, validation_error",
    # the JSON Schemas inside a manifest must themselves be valid, and its approval groups
    # must exist
    "PUT /api/v1/agents/{name}/": "validation_error",
    # a cursor is an opaque token from a previous page's next link; a made-up one is refused
    "GET /api/v1/runs/": "validation_error (cursor)",
    "GET /api/v1/approvals/": "validation_error (cursor)",
    "GET /api/v1/tool-calls/": "validation_error (cursor)",
    # edited arguments must match the tool's own argument schema
    "POST /api/v1/approvals/{approval_id}/decision/": "validation_error",
    # a policy's rules are validated against the tool's argument schema and the groups
    # that exist; a simulation's tool must be registered
    "POST /api/v1/policies/": "validation_error",
    "POST /api/v1/policies/simulations/": "validation_error",
    # a withdrawal's note must say something (spaces alone are not a reason)
    "POST /api/v1/policies/{policy_id}/withdrawal/": "validation_error",
    # the run must have the step to fork from
    "POST /api/v1/runs/{run_id}/fork/": "validation_error",
    # a top-up must add something, and a new deadline must still be in the future
    "POST /api/v1/runs/{run_id}/budget/": "validation_error",
    # a step is numbered after the run's last one
    "POST /api/v1/runs/{run_id}/steps/": "validation_error",
    # the arguments must match *that tool's* argument schema
    "POST /api/v1/runs/{run_id}/tool-calls/": "validation_error",
    # an absent must name the lookup it reports
    "POST /api/v1/tool-calls/{tool_call_id}/receipt/": "validation_error, lookup_required",
    # a failed finish needs a reason
    "POST /api/v1/runs/{run_id}/finish/": "validation_error",
    # a question's group must exist and its default must be one of its choices
    "POST /api/v1/runs/{run_id}/waits/": "validation_error",
}
LABELS = sorted(f"{method.upper()} {path}" for path, method in ENDPOINTS)
# per operation and phase; `make fuzz` sets more (README)
FUZZ_EXAMPLES = int(os.environ.get("AGENTOPS_FUZZ_EXAMPLES", "10"))
POSITIVE_DEFAULT = ["2xx", "3xx", "401", "403", "404", "409", "429", "5xx"]


def schemathesis_config(
    token: str = "", operations: list[dict] | None = None, **extra
) -> schemathesis.Config:
    # NUL characters are refused on purpose with a 400 ``nul_byte`` at every entrance (the
    # JSON rule, docs/api.md; tests/api/test_bad_input.py): not data the schema promises
    generation = {"allow-x00": False, **extra.pop("generation", {})}
    return schemathesis.Config.from_dict(
        {
            **extra,
            "generation": generation,
            # the token as the schema's bearerAuth, so the auth checks probe without it
            "auth": {"openapi": {"bearerAuth": {"bearer": token}}} if token else {},
            "operations": [
                {
                    "include-name": label,
                    "checks": {
                        "positive_data_acceptance": {
                            "expected-statuses": [*POSITIVE_DEFAULT, "400"]
                        }
                    },
                }
                for label in DATA_DEPENDENT_400
            ]
            + (operations or []),
        }
    )


def test_schema_links_create_to_retrieve_and_act(openapi):
    created = openapi["paths"]["/api/v1/runs/"]["post"]["responses"]["201"]["links"]
    assert created["GetRun"] == {
        "operationId": "v1_runs_retrieve",
        "parameters": {"run_id": "$response.body#/id"},
    }
    assert {"PauseRun", "TerminateRun", "LeaseRun", "SignalRun"} <= set(created)
    leased = openapi["paths"]["/api/v1/runs/{run_id}/lease/"]["post"]["responses"]["200"]["links"]
    proof = {"fence": "$response.body#/fence", "lease_token": "$response.body#/lease_token"}
    assert leased["ProposeToolCall"]["requestBody"] == proof
    proposed = openapi["paths"]["/api/v1/runs/{run_id}/tool-calls/"]["post"]["responses"]["201"]
    assert proposed["links"]["DispatchToolCall"]["operationId"] == "v1_tool_calls_dispatch_create"
    assert leased["BeginWait"] == {
        "operationId": "v1_runs_waits_create",
        "parameters": {"run_id": "$response.body#/run"},
        "requestBody": proof,
    }


def test_every_request_body_has_an_example_its_schema_accepts(openapi):
    import jsonschema

    for path, item in openapi["paths"].items():
        for method, operation in item.items():
            body = operation.get("requestBody", {}).get("content", {}).get("application/json")
            if body is None:
                continue
            name = body["schema"]["$ref"].rsplit("/", 1)[1]
            schema = openapi["components"]["schemas"][name]
            # a union (the waits) has its examples on each kind
            kinds = [one["$ref"].rsplit("/", 1)[1] for one in schema.get("oneOf", [])]
            for shown in kinds or [name]:
                example = openapi["components"]["schemas"][shown].get("example")
                assert example is not None, (method, path, shown)
                jsonschema.validate(
                    example,
                    {"$ref": f"#/components/schemas/{shown}", "components": openapi["components"]},
                )


def test_every_operation_on_an_object_is_linked_from_where_its_id_comes_from(openapi):
    """A client (and the stateful fuzzer) reaches every operation that takes an id through a
    link from an operation that returned that id; every link names a real operation."""
    ids = {
        operation["operationId"]: (path, method)
        for path, item in openapi["paths"].items()
        for method, operation in item.items()
    }
    linked = {
        link["operationId"]
        for item in openapi["paths"].values()
        for operation in item.values()
        for response in operation["responses"].values()
        for link in response.get("links", {}).values()
    }
    assert linked <= set(ids)
    taking_an_id = {op for op, (path, _) in ids.items() if "{" in path}
    assert taking_an_id - linked == set()


def test_wait_request_is_one_of_three_kinds(openapi):
    operation = openapi["paths"]["/api/v1/runs/{run_id}/waits/"]["post"]
    assert {"200", "201", "400", "404", "409"} <= set(operation["responses"])
    assert "lease_lost" in operation["responses"]["409"]["description"]
    schemas = openapi["components"]["schemas"]
    request = schemas["WaitInputRequest"]
    assert request["discriminator"]["propertyName"] == "kind"
    assert set(request["discriminator"]["mapping"]) == {"signal", "timer", "question"}
    assert schemas["TimerWaitInputRequest"]["oneOf"] == [
        {"required": ["until"]},
        {"required": ["seconds"]},
    ]


class _OneConnectionPerRequest(WSGIServer):
    """Django's live server, single-threaded: its answers then say ``Connection: close``.
    A kept-alive connection waits ~40 ms per request on delayed ACKs (the server writes
    headers and body apart), which made the coverage phase alone take minutes."""

    def __init__(self, *args, connections_override=None, **kwargs):
        super().__init__(*args, **kwargs)


class _ServerThread(LiveServerThread):
    server_class = _OneConnectionPerRequest


@pytest.fixture
def served(transactional_db) -> Iterator[str]:
    """The app served over HTTP (a file database: the server's thread sees the test's rows)."""
    thread = _ServerThread("localhost", _StaticFilesHandler)
    thread.daemon = True
    thread.start()
    thread.is_ready.wait()
    if thread.error:
        raise thread.error
    yield f"http://localhost:{thread.port}"
    thread.terminate()


# What makes a reached operation's data usable, per operation: a 2xx answer, or for the few
# whose every success depends on a state no generated request sets up, the domain answer
# that shows the ids and the body were real (each says why)
USABLE_WITHOUT_2XX: dict[str, set[int]] = {
    # only the agent's owner reads a run's conversation history, and the fuzzing superuser
    # owns no agent: a real remote run's id answers 403 (a made-up one 404), a hosted run's 409
    "GET /api/v1/runs/{run_id}/messages/": {403, 409},
}


@pytest.mark.django_db(transaction=True)
def test_every_phase_against_a_served_instance(roles, api_agents, django_user_model, served):
    """Schemathesis' own engine against a served instance, every phase (examples, coverage,
    fuzzing, stateful) and every check: no server error, no response outside the schema, and
    every operation reached with usable data (real ids from the links and from the answers
    of earlier operations, and a few parked runs)."""
    from schemathesis import engine
    from schemathesis.engine import Status, events

    from tests.api.conftest import start
    from tests.api.remote_support import register_remote
    from tests.conftest import drive

    root = django_user_model.objects.create_superuser("fuzz", password="x")
    register_remote(root)
    # parked by someone else (separation of duties: the fuzzing user may decide the
    # approval and resolve the call)
    drive(start().id)
    drive(start("api_sender").id)
    config = schemathesis_config(
        token_for(root),
        phases={"stateful": {"max-steps": 10}},
        generation={"max-examples": FUZZ_EXAMPLES, "deterministic": True, "database": "none"},
        # each run starts from what the server says, not from requests a previous run (maybe
        # against the other database) left in Schemathesis' on-disk cache
        cache={"enabled": False},
        operations=[
            # runs of an agent that exists, and calls of its tools with valid arguments, so
            # the links from them lead somewhere real (the rest of the body is generated)
            {
                "include-name": "POST /api/v1/runs/",
                "parameters": {"body.agent": "pay_bot", "body.input": {"order_id": "ord_1001"}},
            },
            {
                "include-name": "POST /api/v1/runs/{run_id}/tool-calls/",
                "parameters": {
                    "body.tool": "refund",
                    "body.arguments": {"order_id": "ord_1001", "amount_cents": 500},
                },
            },
        ],
    )
    # over real HTTP: the engine's WSGI transport does not work with the Werkzeug in use
    api = schemathesis.openapi.from_url(f"{served}/api/schema/", config=config)
    failures: list[str] = []
    answers: dict[str, set[int]] = {label: set() for label in LABELS}
    for event in engine.from_schema(api).execute():
        if isinstance(event, events.ScenarioFinished):
            recorder = event.recorder
            for case_id, interaction in recorder.interactions.items():
                if interaction.response is not None:
                    label = recorder.cases[case_id].value.operation.label
                    answers.setdefault(label, set()).add(interaction.response.status_code)
            for case_id, checks in recorder.checks.items():
                case = recorder.cases[case_id].value
                failures += [
                    f"{case.operation.label}: {check.name}: {check.failure_info.failure.title} "
                    f"{check.failure_info.failure.message} {case.as_curl_command()}"
                    for check in checks
                    if check.status == Status.FAILURE
                ]
        elif isinstance(event, events.FatalError | events.NonFatalError):
            failures.append(f"{type(event).__name__}: {event.info.message}")
    assert not failures, "\n".join(sorted(set(failures)))
    unusable = {
        label: sorted(codes)
        for label, codes in answers.items()
        if not any(200 <= code < 300 for code in codes)
        and not (codes & USABLE_WITHOUT_2XX.get(label, set()))
    }
    assert not unusable, f"reached only with unusable data: {unusable}"

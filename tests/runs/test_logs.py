"""Structured logs (runs/logs.py): every engine line says which run, incarnation, trace,
worker and boundary it is about; JSON for log shippers, a readable line in development."""

from __future__ import annotations

import io
import json
import logging

import pytest

from runs import logs
from runs.models import Run
from runs.services import run_create
from tests.conftest import drive
from tests.runs.workerprocs import wait_for, worker_env

SMALL = {"order_id": "ord_1002", "amount_cents": 700}


@pytest.fixture
def json_lines():
    """The lines the production handler (context filter + JSON formatter) writes."""
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.addFilter(logs.RunContextFilter())
    handler.setFormatter(logs.JsonFormatter())
    root = logging.getLogger()
    previous = root.level
    root.addHandler(handler)
    root.setLevel(logging.INFO)
    yield lambda: [json.loads(line) for line in stream.getvalue().splitlines()]
    root.removeHandler(handler)
    root.setLevel(previous)


def test_a_bound_context_stamps_every_record_and_extra_fields_are_kept(json_lines):
    log = logging.getLogger("agentops.test")
    with logs.bind(run_id="r-1", incarnation=3, trace_id="t" * 32, worker="w1"):
        log.info("inside %s", "the slice", extra={"boundary": "decided", "tool": "refund"})
    log.info("outside")

    inside, outside = json_lines()
    assert inside["message"] == "inside the slice"
    assert (inside["run_id"], inside["incarnation"], inside["worker"]) == ("r-1", 3, "w1")
    assert (inside["trace_id"], inside["boundary"], inside["tool"]) == (
        "t" * 32,
        "decided",
        "refund",
    )
    assert inside["level"] == "INFO" and inside["logger"] == "agentops.test"
    assert "run_id" not in outside  # the context ends with the block


def test_an_exception_is_one_json_object_with_its_traceback(json_lines):
    try:
        raise ValueError("boom")
    except ValueError:
        logging.getLogger("agentops.test").exception("it failed")

    (line,) = json_lines()
    assert line["message"] == "it failed"
    assert "ValueError: boom" in line["exception"]


def test_the_human_format_shows_the_context_after_the_message():
    record = logging.LogRecord("runs.engine", logging.INFO, __file__, 1, "claimed", (), None)
    with logs.bind(run_id="r-1", incarnation=2, worker="w1"):
        logs.RunContextFilter().filter(record)

    line = logs.HumanFormatter().format(record)

    assert line.endswith("INFO runs.engine claimed [run=r-1 inc=2 worker=w1]")


@pytest.mark.django_db
def test_every_engine_line_of_a_run_names_the_run_incarnation_trace_and_worker(
    json_lines, sandbox, system_actor
):
    run = run_create(agent_name="refund", input=SMALL, actor=system_actor)

    drive(run.id, worker="w-log")

    engine_lines = [line for line in json_lines() if line["logger"] == "runs.engine"]
    assert engine_lines
    for line in engine_lines:
        assert line["run_id"] == str(run.id)
        assert line["trace_id"] == run.trace_id
        assert line["worker"] == "w-log"
        assert line["incarnation"] >= 1
    boundaries = [line["boundary"] for line in engine_lines]
    assert boundaries[0] == "claimed"
    assert "decided+dispatching" in boundaries
    assert boundaries[-1] == "decided+run_finished"  # the finish step and the end, one commit


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_a_worker_in_production_log_format_writes_json_lines(worker_procs, sandbox, system_actor):
    worker = worker_procs.start("json-1", worker_env(sandbox, LOG_FORMAT="json", LOG_LEVEL="INFO"))
    run = run_create(agent_name="refund", input=SMALL, actor=system_actor)
    wait_for(
        lambda: Run.objects.get(id=run.id).status == Run.Status.SUCCEEDED,
        30,
        what="the run to succeed",
    )
    worker.kill_group()

    records = [json.loads(line) for line in worker.output().splitlines() if line.startswith("{")]
    checkpoints = [r for r in records if r.get("boundary") and r.get("run_id") == str(run.id)]
    assert {r["worker"] for r in checkpoints} == {"json-1"}
    boundaries = {name for r in checkpoints for name in r["boundary"].split("+")}
    assert {"claimed", "decided", "run_finished"} <= boundaries


# --- link tokens (issue 17) ---------------------------------------------------------------------

TOKEN = "AbCdEfGhIjKlMnOpQrStUvWxYz0123456789_-abcde"


def test_link_tokens_are_redacted_from_gunicorn_access_records():
    from runs.logs import RedactLinkTokens

    atoms = {
        "r": f"GET /approvals/link/{TOKEN}/ HTTP/1.1",
        "f": f"https://agentops.example.com/questions/link/{TOKEN}/",
        "q": f"next=%2Fapprovals%2Flink%2F{TOKEN}%2F",
        "s": "200",
    }
    record = logging.LogRecord(
        "gunicorn.access", logging.INFO, __file__, 1, '"%(r)s" %(s)s "%(f)s" %(q)s', (atoms,), None
    )
    assert RedactLinkTokens().filter(record)
    message = record.getMessage()
    assert TOKEN not in message
    assert "/approvals/link/[redacted]/" in message and "/questions/link/[redacted]/" in message
    assert "%2Flink%2F[redacted]%2F" in message


def test_link_tokens_are_redacted_from_django_request_warnings(rf):
    from runs.logs import JsonFormatter, RedactLinkTokens

    request = rf.get(f"/approvals/link/{TOKEN}/")
    record = logging.LogRecord(
        "django.request", logging.WARNING, __file__, 1, "Not Found: %s", (request.path,), None
    )
    record.request = request
    record.status_code = 404
    RedactLinkTokens().filter(record)
    line = JsonFormatter().format(record)
    assert TOKEN not in line and "link/[redacted]/" in line
    # other paths are left alone
    other = logging.LogRecord("x", logging.INFO, __file__, 1, "GET /runs/%s/", ("abc",), None)
    RedactLinkTokens().filter(other)
    assert other.getMessage() == "GET /runs/abc/"

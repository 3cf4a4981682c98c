"""Webhooks: written with the event that causes them, delivered by the sweeper to a real
HTTP receiver, signed, retried after a failure, refused for non-public addresses."""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import Iterator
from datetime import timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from django.utils import timezone

from agentops.client import WebhookVerificationError, verify_webhook
from runs import engine, remote
from runs.actors import Actor
from runs.models import ApiToken, Run, WebhookDelivery
from runs.registry import Finish
from runs.services import run_create
from runs.tokens import api_token_create
from runs.webhooks import url_refusal, webhooks_deliver_due
from tests.api.remote_support import Agent, register_remote, remote_run
from tests.support import ScriptedAgent, expire_lease

pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("roles")]


class Receiver:
    """A real HTTP server: answers with ``statuses`` in turn (then 200), records requests."""

    def __init__(self, statuses: list[int] | None = None) -> None:
        self.statuses = list(statuses or [])
        self.requests: list[tuple[dict[str, str], bytes]] = []
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["Content-Length"]))
                receiver.requests.append((dict(self.headers), body))
                status = receiver.statuses.pop(0) if receiver.statuses else 200
                self.send_response(status)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args) -> None:
                return

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/hooks"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    started = Receiver([500])
    yield started
    started.stop()


@pytest.fixture
def hooked(operator, receiver) -> ApiToken:
    token, _raw = api_token_create(
        name="hooks", principal=operator, actor=Actor.system("cli"), webhook_url=receiver.url
    )
    return token


@pytest.fixture
def leased(admin, operator, robot, as_robot) -> Agent:
    register_remote(admin, owner=robot)
    agent = Agent(as_robot, remote_run(operator).id)
    assert agent.lease().status_code == 200
    return agent


def _due_now() -> None:
    WebhookDelivery.objects.update(next_attempt_at=timezone.now() - timedelta(seconds=1))


def test_run_finished_is_signed_and_retried_after_a_500(hooked, receiver, leased):
    leased.run_post("finish", {"result": {"ok": True}})
    (delivery,) = WebhookDelivery.objects.all()
    assert delivery.event_type == "run.finished" and delivery.token == hooked

    assert webhooks_deliver_due() == 0  # the receiver answered 500
    delivery.refresh_from_db()
    assert (delivery.status, delivery.attempts, delivery.last_status_code) == ("pending", 1, 500)
    assert delivery.next_attempt_at is not None

    _due_now()
    assert webhooks_deliver_due() == 1
    delivery.refresh_from_db()
    assert (delivery.status, delivery.attempts, delivery.last_status_code) == ("delivered", 2, 200)

    assert len(receiver.requests) == 2
    headers, body = receiver.requests[-1]
    payload = verify_webhook(hooked.webhook_secret, headers, body)
    assert payload["type"] == "run.finished"
    assert payload["run"] == {"id": leased.run_id, "agent": "pay_bot", "status": "succeeded"}
    assert payload["event"]["type"] == "run.succeeded"
    assert headers["Agentops-Webhook-Event"] == "run.finished"
    assert headers["Agentops-Webhook-Id"] == str(delivery.id)


def test_receiver_rejects_bad_signatures_and_stale_timestamps(hooked, receiver, leased):
    leased.run_post("finish", {"result": {}})
    _due_now()
    webhooks_deliver_due()
    _due_now()
    webhooks_deliver_due()
    headers, body = receiver.requests[-1]
    timestamp = int(headers["Agentops-Webhook-Timestamp"])

    with pytest.raises(WebhookVerificationError, match="stale"):
        verify_webhook(hooked.webhook_secret, headers, body, now=timestamp + 301)
    with pytest.raises(WebhookVerificationError, match="signature"):
        verify_webhook("another-secret", headers, body)
    with pytest.raises(WebhookVerificationError, match="signature"):
        verify_webhook(hooked.webhook_secret, headers, body.replace(b"succeeded", b"failed"))
    # the delivery id is signed: a replay cannot pass for a new delivery under another id
    with pytest.raises(WebhookVerificationError, match="signature"):
        verify_webhook(hooked.webhook_secret, {**headers, "Agentops-Webhook-Id": "999999"}, body)
    assert headers["Agentops-Webhook-Signature"].startswith("v2=")


def test_approval_decided_and_lease_expired(hooked, leased, as_approver):
    approval = leased.propose("refund", {"order_id": "o", "amount_cents": 50000}).json()["approval"]
    as_approver.post(f"/api/v1/approvals/{approval}/decision/", {"decision": "approve"})
    leased.lease()
    expire_lease(leased.run_id)
    remote.remote_leases_expire()

    kinds = list(WebhookDelivery.objects.order_by("id").values_list("event_type", flat=True))
    assert kinds == ["approval.decided", "run.lease_expired"]
    decided = WebhookDelivery.objects.get(event_type="approval.decided").payload
    assert decided["event"]["payload"]["approval"] == approval
    assert decided["event"]["payload"]["decision"] == "approve"


def test_needs_attention(hooked, leased, operator):
    Run.objects.filter(id=leased.run_id).update(max_steps=0)
    leased.run_post("steps", {})
    (delivery,) = WebhookDelivery.objects.all()
    assert delivery.event_type == "run.needs_attention"
    assert delivery.payload["event"]["payload"]["reason"] == "budget_exhausted"


def test_a_rolled_back_event_gets_no_delivery(hooked, leased):
    stale = Agent(leased.client, leased.run_id)
    stale.fence, stale.lease_token = leased.fence + 1, leased.lease_token
    stale.run_post("finish", {"result": {}})  # lease_lost: nothing written
    assert not WebhookDelivery.objects.exists()


def test_only_the_runs_principal_tokens_hear(hooked, leased, approver):
    api_token_create(
        name="other", principal=approver, actor=Actor.system("cli"), webhook_url=hooked.webhook_url
    )
    leased.run_post("finish", {"result": {}})
    assert list(WebhookDelivery.objects.values_list("token__name", flat=True)) == ["hooks"]


def test_the_agents_owner_hears_the_runs_it_drives(hooked, leased, robot, approver):
    """The service account that owns a remote agent learns when to lease its runs again
    (approval decided, wait ended), though someone else started them."""
    api_token_create(
        name="agent", principal=robot, actor=Actor.system("cli"), webhook_url=hooked.webhook_url
    )
    api_token_create(
        name="other", principal=approver, actor=Actor.system("cli"), webhook_url=hooked.webhook_url
    )
    leased.run_post("finish", {"result": {}})
    heard = WebhookDelivery.objects.values_list("token__name", flat=True)
    assert sorted(heard) == ["agent", "hooks"]


def test_revoked_tokens_hear_nothing(hooked, leased):
    ApiToken.objects.filter(id=hooked.id).update(revoked_at=timezone.now())
    leased.run_post("finish", {"result": {}})
    assert not WebhookDelivery.objects.exists()


def test_private_addresses_are_refused(settings, hooked, leased, receiver):
    settings.AGENTOPS = {**settings.AGENTOPS, "WEBHOOK_ALLOWED_NETWORKS": []}
    leased.run_post("finish", {"result": {}})

    assert webhooks_deliver_due() == 0
    delivery = WebhookDelivery.objects.get()
    assert delivery.status == "failed" and "non-public" in delivery.last_error
    assert receiver.requests == []


@pytest.mark.parametrize(
    "url",
    [
        "http://10.1.2.3/x",
        "http://169.254.169.254/latest",
        "http://[::1]/x",
        "ftp://example.com/",
        # IPv6 forms of internal IPv4 addresses (issue 17): NAT64, 6to4, IPv4-mapped,
        # IPv4-compatible, Teredo, and the local-use NAT64 prefix
        "http://[64:ff9b::a9fe:a9fe]/latest",  # 169.254.169.254
        "http://[64:ff9b::7f00:1]/x",
        "http://[2002:a00:1::1]/x",  # 10.0.0.1
        "http://[2002:7f00:1::]/x",
        "http://[::ffff:127.0.0.1]/x",
        "http://[::ffff:a9fe:a9fe]/x",
        "http://[::10.0.0.1]/x",
        "http://[2001:0:4136:e378:8000:63bf:f5ff:fffe]/x",
        "http://[64:ff9b:1::808:808]/x",
    ],
)
def test_url_refusal(settings, url):
    settings.AGENTOPS = {**settings.AGENTOPS, "WEBHOOK_ALLOWED_NETWORKS": []}
    assert url_refusal(url)


def test_loopback_allowed_by_setting(settings):
    settings.AGENTOPS = {**settings.AGENTOPS, "WEBHOOK_ALLOWED_NETWORKS": ["127.0.0.0/8"]}
    assert url_refusal("http://127.0.0.1:9/x") == ""
    # the same address in its IPv4-mapped form is the same address
    assert url_refusal("http://[::ffff:127.0.0.1]:9/x") == ""


@pytest.mark.parametrize(
    "url", ["http://[64:ff9b::808:808]/x", "http://[2002:808:808::1]/x", "http://8.8.8.8/x"]
)
def test_public_ipv4_addresses_in_ipv6_forms_may_be_called(settings, url):
    settings.AGENTOPS = {**settings.AGENTOPS, "WEBHOOK_ALLOWED_NETWORKS": []}
    assert url_refusal(url) == ""


def test_gives_up_after_max_attempts(settings, hooked, leased, receiver):
    settings.AGENTOPS = {**settings.AGENTOPS, "WEBHOOK_MAX_ATTEMPTS": 2}
    receiver.statuses = [500, 503]
    leased.run_post("finish", {"result": {}})
    webhooks_deliver_due()
    _due_now()
    webhooks_deliver_due()
    delivery = WebhookDelivery.objects.get()
    assert (delivery.status, delivery.attempts, delivery.last_error) == (
        "failed",
        2,
        "answered 503",
    )


def test_payload_is_json(hooked, leased):
    leased.run_post("finish", {"result": {"n": 1}})
    payload = WebhookDelivery.objects.get().payload
    assert json.loads(json.dumps(payload))["event"]["payload"]["result"] == {"n": 1}


def test_worker_alerts_go_to_admin_tokens(admin, receiver, hooked):
    from runs import alerts
    from runs.models import Alert
    from runs.webhooks import enqueue_for_alert

    api_token_create(
        name="ops", principal=admin, actor=Actor.system("cli"), webhook_url=receiver.url
    )
    assert enqueue_for_alert in alerts.ALERT_LISTENERS
    alert = Alert.objects.create(
        cause="worker_stopped:w1:x", kind=Alert.Kind.WORKER_STOPPED, worker_name="w1", detail="gone"
    )

    enqueue_for_alert(alert)

    (delivery,) = WebhookDelivery.objects.all()
    assert delivery.token.name == "ops" and delivery.event_type == "alert.raised"
    assert delivery.payload["alert"]["worker"] == "w1"


def test_a_delivery_connects_to_the_address_it_checked(monkeypatch, hooked, leased, receiver):
    """DNS rebinding: the name answers with an allowed address for the check, then with an
    internal one. The delivery goes to the address that was checked, with the name in the
    Host header; a second lookup of the name is never used."""
    port = receiver.server.server_address[1]
    ApiToken.objects.filter(id=hooked.id).update(webhook_url=f"http://hooks.example:{port}/in")
    real_getaddrinfo = socket.getaddrinfo
    answers = iter(["127.0.0.1"])  # the first lookup; every later one says 10.0.0.1
    lookups = []

    def getaddrinfo(host, port, *args, **kwargs):
        if host != "hooks.example":
            return real_getaddrinfo(host, port, *args, **kwargs)
        lookups.append(host)
        address = next(answers, "10.0.0.1")
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (address, port))]

    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)
    receiver.statuses = []
    leased.run_post("finish", {"result": {}})

    assert webhooks_deliver_due() == 1
    assert lookups == ["hooks.example"]
    headers, body = receiver.requests[-1]
    assert headers["Host"] == f"hooks.example:{port}"
    assert verify_webhook(hooked.webhook_secret, headers, body)["type"] == "run.finished"


@pytest.mark.django_db(transaction=True)
def test_a_hosted_run_finished_by_a_worker_gets_its_delivery(register, hooked, operator):
    """A worker records a finish without locking the run first (runs.record.checkpoint,
    ``checkpoint(expect=...)``): the delivery is still written in the same commit as the
    event that causes it."""
    register(ScriptedAgent("hooked_quick", lambda ctx: Finish({"ok": True}), tools=()))
    run = run_create(agent_name="hooked_quick", actor=Actor.for_user(operator, "api"))

    assert engine.advance(run.id, worker="w1") == "parked"

    assert Run.objects.get(id=run.id).status == Run.Status.SUCCEEDED
    delivery = WebhookDelivery.objects.get(run_id=run.id)
    assert (delivery.token_id, delivery.event_type) == (hooked.id, "run.finished")
    assert delivery.payload["run"]["status"] == "succeeded"

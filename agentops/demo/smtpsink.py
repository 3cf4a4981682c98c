"""A real SMTP server in a thread that keeps every message it receives (aiosmtpd, a
development dependency): the chaos harness points its workers at one to check that every
approver was told, and with a link that works (DESIGN §9)."""

from __future__ import annotations

import email
import email.policy
import logging
import re
import socket
import threading
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

LINK = re.compile(r"https?://[^\s\"'<>]+?(/approvals/link/[A-Za-z0-9_-]+/)")


@dataclass(frozen=True)
class Received:
    message_id: str
    to: tuple[str, ...]
    subject: str
    approval: str  # X-Agentops-Approval, "" when it is about something else
    question: str  # X-Agentops-Question
    text: str
    at: float  # time.monotonic() of its arrival
    at_wall: datetime

    @property
    def approval_link_path(self) -> str:
        match = LINK.search(self.text)
        return match.group(1) if match else ""


class SmtpSink:
    def __init__(self) -> None:
        self.messages: list[Received] = []
        self._lock = threading.Lock()
        self._controller: Any = None
        self.port = 0

    async def handle_DATA(self, server, session, envelope):  # noqa: N802 -- aiosmtpd's name
        raw = envelope.original_content or envelope.content
        message = email.message_from_bytes(raw, policy=email.policy.default)
        body = message.get_body(preferencelist=("plain",))
        received = Received(
            message_id=str(message["Message-ID"] or ""),
            to=tuple(envelope.rcpt_tos),
            subject=str(message["Subject"] or ""),
            approval=str(message["X-Agentops-Approval"] or ""),
            question=str(message["X-Agentops-Question"] or ""),
            text=body.get_content() if body is not None else "",
            at=time.monotonic(),
            at_wall=datetime.now(UTC),
        )
        with self._lock:
            self.messages.append(received)
        return "250 Message accepted for delivery"

    def start(self) -> int:
        from aiosmtpd.controller import Controller

        # aiosmtpd logs every SMTP command at INFO: the harness's output is for its findings
        logging.getLogger("mail.log").setLevel(logging.WARNING)

        # aiosmtpd's start-up self-check connects to the port it was given: port=0 fails
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            self.port = sock.getsockname()[1]
        self._controller = Controller(self, hostname="127.0.0.1", port=self.port)
        self._controller.start()
        return self.port

    def stop(self) -> None:
        if self._controller is not None:
            self._controller.stop()
            self._controller = None

    def snapshot(self) -> list[Received]:
        with self._lock:
            return list(self.messages)

    def about_approval(self, approval_id: Any, address: str) -> list[Received]:
        return [
            m
            for m in self.snapshot()
            if m.approval == str(approval_id) and address in m.to and m.approval_link_path
        ]

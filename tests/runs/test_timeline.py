"""The timeline's wording for email events: an operator reads who was emailed and who used
the link, not raw event names."""

from __future__ import annotations

import pytest

from runs.timeline import describe


@pytest.mark.parametrize(
    ("event_type", "payload", "text"),
    [
        (
            "question.email_sent",
            {"question_id": 3, "to": "olivia"},
            "question #3 emailed to olivia",
        ),
        (
            "question.email_sent",
            {"question_id": 3, "to": "olivia", "resent": True},
            "question #3 emailed again to olivia",
        ),
        (
            "approval.email_failed",
            {"approval": 5, "to": "bob", "error": "SMTPException: down"},
            "approval #5: email to bob failed (SMTPException: down)",
        ),
        (
            "approval.link_used",
            {"approval": 5, "by": "user:alice"},
            "approval #5: emailed link used by user:alice",
        ),
        (
            "question.link_used",
            {"question_id": 3, "by": "user:olivia"},
            "question #3: emailed link used by user:olivia",
        ),
    ],
)
def test_email_events_read_as_sentences(event_type, payload, text):
    assert describe(event_type, payload, "system") == text


def test_an_approval_request_says_what_the_call_does():
    from runs.timeline import describe

    line = describe(
        "approval.requested",
        {
            "approval": 7,
            "seq": 2,
            "tool": "refund_payment",
            "group": "approver",
            "arguments": {"order_id": "ord_1004", "amount_cents": 250_000},
        },
    )
    assert line == (
        "approval #7 requested for call #2 (refund_payment) from approver: "
        "Refund 2,500.00 EUR to order ord_1004"
    )

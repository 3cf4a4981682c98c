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

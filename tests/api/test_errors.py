"""Errors the API did not foresee still answer with a code, never a 500 with a traceback."""

from __future__ import annotations

import pytest
from django.db import IntegrityError

from runs.api.common import exception_handler


@pytest.mark.django_db
def test_a_race_lost_on_a_unique_row_is_a_409_and_writes_nothing():
    # what two identical step writes sent at once by one process end in: the second
    # transaction hits the unique (run, seq) and is rolled back
    response = exception_handler(IntegrityError("duplicate key value"), {})

    assert response.status_code == 409
    assert response.data["code"] == "invalid_state"
    assert "nothing was written" in response.data["detail"]

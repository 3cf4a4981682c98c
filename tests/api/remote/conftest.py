"""The remote-agent protocol's fixtures: a run of the ``pay_bot`` manifest
(``remote_support.MANIFEST``) and an agent process holding its lease. Kept in this folder so
that they shadow no other test module's own ``run``."""

from __future__ import annotations

import pytest

from runs.models import Run
from tests.api.remote_support import Agent, register_remote, remote_run


@pytest.fixture
def run(admin, operator, robot) -> Run:
    register_remote(admin, owner=robot)
    return remote_run(operator)


@pytest.fixture
def agent(run, as_robot) -> Agent:
    """The agent process: a token of the service account that owns the agent."""
    return Agent(as_robot, run.id)


@pytest.fixture
def leased(agent) -> Agent:
    assert agent.lease(owner="proc-1").status_code == 200
    return agent

"""Framework agents as real processes against a live server and the sandbox (in its
non-deduplicating mode): each registers the demo refunder's manifest under its own name,
owned by a service account in the agent role."""

from __future__ import annotations

import pytest

from agentops.demo.remote_agent import MANIFEST
from runs.actors import Actor
from runs.remote import agent_manifest_put
from tests.api.conftest import token_for


@pytest.fixture
def register_refunder(robot, django_user_model):
    """``register_refunder(name)``: the demo refunder's manifest (a reconcilable refund that
    needs an approval above 100.00) under ``name``; returns a token of its owner."""
    admin = django_user_model.objects.create_superuser("root", password="x")

    def register(name: str) -> str:
        manifest = {**MANIFEST, "owner": robot.username}
        agent_manifest_put(name=name, manifest=manifest, actor=Actor.for_user(admin, "cli"))
        return token_for(robot, name)

    return register

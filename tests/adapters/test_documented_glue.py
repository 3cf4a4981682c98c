"""The framework adapters' examples in docs/remote-agents.md ("Framework adapters") are true:
the tool block saved as ``refund_tools.py`` and each framework's block as the agent, exactly
as written — only the model swapped for an offline one — run as a user runs them against a
live server and the sandbox (non-deduplicating), and refund the order once. And the glue
stays under 20 lines (the issue's "Done when")."""

from __future__ import annotations

import re

import pytest

from runs.actors import Actor
from runs.models import Run
from runs.services import run_create
from tests.agentproc import ROOT, AgentProcess
from tests.support import refund_posts, refunds

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("roles")]

# what the documented agent asks for, and the offline model it gets in its place
MODELS = {
    "pydantic_ai": ('Agent("openai:gpt-5", ', "Agent(MODEL, ", "pydantic_model"),
    "openai_agents": ('model="gpt-5"', "model=MODEL", "openai_model"),
}


def documented_blocks() -> dict[str, str]:
    text = (ROOT / "docs" / "remote-agents.md").read_text()
    section = text[text.index("## Framework adapters") :]
    section = section[: section.index("\n## ", 1)] if "\n## " in section[1:] else section
    tool, pydantic_ai, openai_agents = re.findall(r"```python\n(.*?)```", section, re.S)[:3]
    return {"tool": tool, "pydantic_ai": pydantic_ai, "openai_agents": openai_agents}


def code_lines(block: str) -> list[str]:
    return [line for line in block.splitlines() if line.strip()]


def test_the_glue_is_under_20_lines():
    blocks = documented_blocks()
    for framework in MODELS:
        assert len(code_lines(blocks[framework])) < 20, framework
        assert "from refund_tools import find_refund, refund_payment" in blocks[framework]
    assert "def refund_payment" in blocks["tool"] and "def find_refund" in blocks["tool"]


@pytest.mark.parametrize("framework", sorted(MODELS))
def test_the_documented_agent_refunds_once(
    framework, tmp_path, register_refunder, live_server, sandbox, operator
):
    name = f"documented_{framework}"
    token = register_refunder(name)
    blocks = documented_blocks()
    documented, offline, factory = MODELS[framework]
    assert documented in blocks[framework]
    (tmp_path / "refund_tools.py").write_text(blocks["tool"])
    agent = tmp_path / "refunder.py"
    agent.write_text(
        f"from tests.adapters.doc_models import {factory}\nMODEL = {factory}()\n"
        + blocks[framework].replace(documented, offline)
    )
    run = run_create(
        agent_name=name,
        input={"order_id": "ord_1002", "amount_cents": 1500},
        actor=Actor.for_user(operator, "api"),
    )

    process = AgentProcess(
        str(agent), str(run.id), token=token, sandbox_url=sandbox.url, AGENTOPS_URL=live_server.url
    )

    assert process.finish() == 0, process.seen
    assert process.seen[-1] == "finished", process.seen
    run.refresh_from_db()
    assert run.status == Run.Status.SUCCEEDED
    assert len(refunds(sandbox)) == 1 and len(refund_posts(sandbox)) == 1
    assert "done:" in str(run.result)

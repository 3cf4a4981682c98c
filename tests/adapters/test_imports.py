"""The adapters live beside the client and keep its promise: no Django, and the framework
only when its adapter is imported (``agentops.client`` works without either framework)."""

from __future__ import annotations

import subprocess
import sys

from tests.agentproc import ROOT


def _python(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"},
        timeout=60,
    )


def test_adapters_import_no_django():
    done = _python(
        "import sys\n"
        "import agentops.client.pydantic_ai, agentops.client.openai_agents\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('django', 'runs')))"
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def test_the_client_works_without_the_frameworks():
    # a process where neither framework can be imported
    done = _python(
        "import sys\n"
        "sys.modules.update({'pydantic_ai': None, 'agents': None})\n"
        "import agentops.client, agentops.client.routing\n"
        "agentops.client.Client('http://127.0.0.1:9', 'token').close()\n"
        "for name in ('pydantic_ai', 'openai_agents'):\n"
        "    try:\n"
        "        __import__(f'agentops.client.{name}')\n"
        "    except ImportError as exc:\n"
        "        print(exc)\n"
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [
        "agentops.client.pydantic_ai needs Pydantic AI: pip install 'agentops[frameworks]' "
        "(or pydantic-ai-slim)",
        "agentops.client.openai_agents needs the OpenAI Agents SDK: "
        "pip install 'agentops[frameworks]' (or openai-agents)",
    ]

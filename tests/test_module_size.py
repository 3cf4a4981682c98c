"""No module in ``runs/`` over ~800 lines without a reason written at its top (issue 22): a
module past that size is split by concern (DESIGN §1: "split a module into a package only when
it passes ~800 lines"), or says in its first lines why it stays whole — ``# size: <reason>``."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LIMIT = 800
# the reason is looked for in the module's first lines: before or just after its docstring
HEAD = 40
REASON = re.compile(r"^# size: \S.{10,}", re.MULTILINE)


def oversized() -> dict[str, int]:
    found = {}
    for path in sorted((ROOT / "runs").rglob("*.py")):
        if "migrations" in path.parts:
            continue
        lines = path.read_text().count("\n")
        if lines > LIMIT:
            found[str(path.relative_to(ROOT))] = lines
    return found


def test_every_module_in_runs_over_the_limit_says_why_at_its_top():
    unexplained = [
        f"{name} ({lines} lines)"
        for name, lines in oversized().items()
        if not REASON.search("\n".join((ROOT / name).read_text().splitlines()[:HEAD]))
    ]
    assert not unexplained, (
        f"over {LIMIT} lines with no '# size: <reason>' in the first {HEAD} lines "
        "(split it by concern, or say why it stays whole): " + ", ".join(unexplained)
    )


def test_a_reason_is_a_sentence_not_a_marker():
    assert REASON.search("# size: one table per model; Django needs them in one module")
    assert not REASON.search("# size: ok")
    assert not REASON.search("x = 1  # size: a comment at the end of a line")

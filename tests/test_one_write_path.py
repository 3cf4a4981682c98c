"""One write path (issue 19): nothing outside ``runs/record/`` sets a run's, a step's or a
tool call's status — not by attribute, ``update(status=…)``, ``update(**{…})``, a create
with a status, a checkpoint's ``cp.update(status=…)`` or raw SQL. The source is read, so it
stays true.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("runs", "approvals", "agentops")
RECORD = ROOT / "runs" / "record"
MODELS = {"Run", "Step", "ToolCall"}
# names the code gives a run, a step or a call
HOLDERS = re.compile(r"(^|\.)(run|step|call|sibling|parent|child|fork|lease\.run)$")
WRITES = {
    "update",
    "create",
    "save_fields",
    "update_row",
    "insert",
    "get_or_create",
    "update_or_create",
    "bulk_create",
    "bulk_update",
    "_run_update",
    *MODELS,
}
SQL = re.compile(r"\bset\b[^;]*\bstatus\s*=|\"status\"\s*=", re.IGNORECASE)

# modules whose ``status`` is another table's (the outbox writes its messages' rows)
OTHER_TABLES = {"runs/outbox.py"}


def _root_name(node: ast.AST) -> str:
    while isinstance(node, ast.Attribute | ast.Call):
        node = node.value if isinstance(node, ast.Attribute) else node.func
    return node.id if isinstance(node, ast.Name) else ""


def _is_other_status(value: ast.AST) -> bool:
    """``Approval.Status.X``, ``Delivery.Status.Y``: another model's status."""
    return (
        isinstance(value, ast.Attribute)
        and isinstance(value.value, ast.Attribute)
        and value.value.attr == "Status"
        and _root_name(value) not in MODELS
    )


def _mentions_record_status(value: ast.AST) -> bool:
    return any(
        isinstance(node, ast.Attribute)
        and node.attr == "Status"
        and isinstance(node.value, ast.Name)
        and node.value.id in MODELS
        for node in ast.walk(value)
    )


def _status_writes(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign | ast.AugAssign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                if isinstance(target, ast.Attribute) and target.attr == "status":
                    holder = ast.unparse(target.value)
                    if HOLDERS.search(holder) or _mentions_record_status(node.value):
                        found.append(f"{path.relative_to(ROOT)}:{node.lineno} {holder}.status =")
        elif isinstance(node, ast.Call):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            if name not in WRITES:
                continue
            root = _root_name(func)
            if root[:1].isupper() and root not in MODELS:
                continue  # another model's rows: Approval.objects…update(status=…)
            for keyword in node.keywords:
                if keyword.arg == "status" and not _is_other_status(keyword.value):
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno} {name}(status=…)")
                elif keyword.arg is None and isinstance(keyword.value, ast.Dict):
                    keys = [k.value for k in keyword.value.keys if isinstance(k, ast.Constant)]
                    if "status" in keys:
                        found.append(f"{path.relative_to(ROOT)}:{node.lineno} {name}(**{{status}})")
        elif (
            isinstance(node, ast.Constant)
            and isinstance(node.value, str)
            and SQL.search(node.value)
            and re.search(r"runs_(run|step|toolcall)\b", node.value)
        ):
            found.append(f"{path.relative_to(ROOT)}:{node.lineno} SQL sets status")
    return found


def _sources():
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            if "migrations" in path.parts or path.is_relative_to(RECORD):
                continue
            if str(path.relative_to(ROOT)) in OTHER_TABLES:
                continue
            yield path


def test_no_status_is_written_outside_the_record():
    writes = {str(p.relative_to(ROOT)): _status_writes(p) for p in _sources()}
    outside = [w for found in writes.values() for w in found]
    assert not outside, "status written outside runs/record/:\n" + "\n".join(outside)


def test_the_scanner_sees_every_way_of_writing(tmp_path):
    sample = tmp_path / "sample.py"
    sample.write_text(
        "run.status = Run.Status.QUEUED\n"
        "x.status = ToolCall.Status.UNKNOWN\n"
        "Run.objects.filter(id=1).update(status='queued')\n"
        "Run.objects.filter(id=1).update(**{'status': s})\n"
        "cp.update(status=status)\n"
        "Step.objects.create(run=r, status=Step.Status.FAILED)\n"
        "c.execute('UPDATE runs_run SET status = %s')\n"
        "Approval.objects.filter(id=1).update(status=Approval.Status.APPROVED)\n"
        "approval.status = Approval.Status.APPROVED\n"
        "Run.objects.filter(status=Run.Status.RUNNING).count()\n"
    )
    global ROOT
    saved, ROOT = ROOT, tmp_path
    try:
        found = _status_writes(sample)
    finally:
        ROOT = saved
    assert [line.split(":")[1].split()[0] for line in found] == ["1", "2", "3", "4", "5", "6", "7"]


def test_the_remote_protocol_uses_only_the_engines_public_names():
    """One engine for hosted and remote runs: ``runs.remote`` calls the engine through the
    names ``runs.engine`` exports, never through an underscore name or a submodule."""
    found = []
    for path in sorted((ROOT / "runs" / "remote").rglob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Name)
                and node.value.id == "engine"
                and node.attr.startswith("_")
            ):
                found.append(f"{path.relative_to(ROOT)}:{node.lineno} engine.{node.attr}")
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith(
                "runs.engine."
            ):
                found.append(f"{path.relative_to(ROOT)}:{node.lineno} from {node.module}")
    assert not found, "\n".join(found)

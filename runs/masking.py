"""Masking by origin: values a tool declared sensitive in its *result* (docs/audit.md,
"Sensitive values").

Sensitive *arguments* are masked when they are written (``Tool.sensitive_fields``): events,
approvals and pages only ever hold the masked copy. A result cannot be treated that way: the
engine stores it as it came (the receipt, the step's output) and the agent copies parts of it
into its state, its later arguments, its questions and its result, all of which the agent
itself must read back unmasked. So results are masked when they are *shown*:

- a tool declares paths into its result (``Tool.sensitive_output``: dotted keys, ``*`` for
  every item of a list);
- the values found at those paths in the run's receipts are the run's sensitive values (its
  origin record: the receipts are the authoritative record of what each tool answered, and a
  fork carries its parent's receipts);
- everything about the run that is shown to a person — state, result, step outputs, receipts,
  event payloads, arguments, questions, errors — goes through one ``Masker`` that replaces
  each of those values wherever it appears: a string of at least ``MIN_SUBSTRING`` characters
  also inside longer strings (an agent writes ``"Dear bob@example.com"``), shorter strings and
  numbers where they are a whole value; and, in a receipt or a step output of the tool that
  declared it, the whole subtree at the path.

Only people and exports are masked: the engine, the hosted agent and the remote lease holder
read the record itself. People with ``runs.view_sensitive`` (a superuser has it) see the
values. Because masking is done when shown and from today's declaration, declaring a path
masks past runs too, and it is not part of the tool's fingerprint (``runs.registry``).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from runs.models import Run, ToolReceipt
from runs.registry import UnknownAgent, registry

MASK = "***"
VIEW_SENSITIVE = "runs.view_sensitive"
# Shorter strings are masked only as whole values: masking "ab" inside every string would
# make a page unreadable, and a value that short identifies little inside a longer text.
MIN_SUBSTRING = 4


# --- paths ------------------------------------------------------------------------------------


def values_at(data: Any, path: str) -> Iterator[Any]:
    """The values at ``path`` in ``data`` (none when the path is absent)."""
    found = [data]
    for segment in path.split("."):
        following = []
        for value in found:
            if segment == "*" and isinstance(value, list):
                following.extend(value)
            elif isinstance(value, Mapping) and segment in value:
                following.append(value[segment])
        found = following
    return iter(found)


def mask_paths(data: Any, paths: Iterable[str]) -> Any:
    """A copy of ``data`` with the value at each path replaced by the mask."""
    for path in paths:
        data = _mask_path(data, path.split("."))
    return data


def _mask_path(data: Any, segments: list[str]) -> Any:
    if not segments:
        return MASK
    head, rest = segments[0], segments[1:]
    if head == "*" and isinstance(data, list):
        return [_mask_path(item, rest) for item in data]
    if isinstance(data, Mapping) and head in data:
        return {key: (_mask_path(v, rest) if key == head else v) for key, v in data.items()}
    return data


def _leaves(value: Any) -> Iterator[Any]:
    if isinstance(value, Mapping):
        for item in value.values():
            yield from _leaves(item)
    elif isinstance(value, list):
        for item in value:
            yield from _leaves(item)
    else:
        yield value


def sensitive_values(result: Any, paths: Iterable[str]) -> set[Any]:
    """The scalar values at ``paths`` in one result. ``None``, booleans and empty strings
    identify nothing and would mask every equal value: they are left out."""
    found = set()
    for path in paths:
        for value in values_at(result, path):
            for leaf in _leaves(value):
                if isinstance(leaf, bool) or leaf is None or leaf == "":
                    continue
                if isinstance(leaf, str | int | float):
                    found.add(leaf)
    return found


# --- the masker --------------------------------------------------------------------------------


@dataclass
class Masker:
    """Masks one run's sensitive values. Empty: masks nothing (no sensitive values, or a
    viewer allowed to see them)."""

    values: frozenset[Any] = frozenset()
    # tool name -> declared paths: a receipt or step output of that tool is masked by path
    paths: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    # templates pass it to the ``masked`` filters; they must not call it themselves
    do_not_call_in_templates = True

    def __post_init__(self) -> None:
        long = sorted(
            (v for v in self.values if isinstance(v, str) and len(v) >= MIN_SUBSTRING),
            key=len,
            reverse=True,  # the longest first: a value inside another is not cut in two
        )
        self._pattern = re.compile("|".join(map(re.escape, long))) if long else None
        # numbers by value (1 == 1.0); a string only equals a string
        self._whole = {v for v in self.values if not isinstance(v, str) or len(v) < MIN_SUBSTRING}

    def __bool__(self) -> bool:
        return bool(self.values) or bool(self.paths)

    def __call__(self, data: Any) -> Any:
        """``data`` (JSON-like, or text) with every sensitive value masked."""
        if not self.values:
            return data
        return self._value(data)

    def output(self, tool_name: str, data: Any) -> Any:
        """A result of ``tool_name`` (a receipt, a tool step's output): its declared paths
        masked whole, then every sensitive value."""
        paths = self.paths.get(tool_name)
        return self(mask_paths(data, paths) if paths else data)

    def _value(self, data: Any) -> Any:
        if isinstance(data, str):
            return self.text(data)
        if isinstance(data, Mapping):
            return {
                self.text(k) if isinstance(k, str) else k: self._value(v) for k, v in data.items()
            }
        if isinstance(data, list | tuple):
            return [self._value(item) for item in data]
        if isinstance(data, bool) or data is None:
            return data
        try:
            return MASK if data in self._whole else data
        except TypeError:  # unhashable: not a JSON scalar
            return data

    def text(self, text: str) -> str:
        if text in self._whole:
            return MASK
        if self._pattern is None:
            return text
        return self._pattern.sub(MASK, text)


UNMASKED = Masker()


def may_see_sensitive(user: Any) -> bool:
    return bool(user is not None and user.is_active and user.has_perm(VIEW_SENSITIVE))


def _declared_paths(agent_names: Iterable[str]) -> dict[str, tuple[str, ...]]:
    """Tool name -> sensitive output paths, for the registered hosted tools and the tools
    of these agents (a remote agent's tools are in its manifest)."""
    paths = {tool.name: tool.sensitive_output for tool in registry.tools() if tool.sensitive_output}
    for name in set(agent_names):
        try:
            paths.update(registry.agent(name).sensitive_outputs())
        except UnknownAgent:  # retired: its hosted tools are still covered above
            continue
    return paths


def maskers_for(runs: Iterable[Run], *, user: Any = None) -> dict[Any, Masker]:
    """Run id -> the masker for showing that run to ``user`` (None: to nobody in particular,
    e.g. an email or an export). One query for all the runs, none when no tool declares a
    sensitive output."""
    runs = list(runs)
    if may_see_sensitive(user):
        return {run.id: UNMASKED for run in runs}
    paths = _declared_paths(run.agent_name for run in runs)
    values: dict[Any, set[Any]] = {run.id: set() for run in runs}
    if paths and runs:
        receipts = ToolReceipt.objects.filter(
            tool_call__run_id__in=list(values), tool_call__tool_name__in=list(paths)
        ).values_list("tool_call__run_id", "tool_call__tool_name", "result")
        for run_id, tool_name, result in receipts:
            values[run_id] |= sensitive_values(result, paths[tool_name])
    return {run_id: Masker(frozenset(found), paths) for run_id, found in values.items()}


def masker_for(run: Run, *, user: Any = None) -> Masker:
    """The masker for showing ``run`` to ``user`` (None: to nobody in particular)."""
    return maskers_for([run], user=user)[run.id]


def maskers_for_ids(run_ids: Iterable[Any], *, user: Any = None) -> dict[Any, Masker]:
    """``maskers_for`` by run id (one more query, for the runs' agents)."""
    if may_see_sensitive(user):
        return {run_id: UNMASKED for run_id in run_ids}
    return maskers_for(Run.objects.filter(id__in=set(run_ids)).only("id", "agent_name"), user=user)


def masked_rows(
    rows: Iterable[Any],
    *,
    run_id: Any,
    fields: tuple[str, ...],
    user: Any = None,
    chunk_size: int = 500,
) -> Iterator[Any]:
    """Rows of many runs (an export, streamed) with ``fields`` masked for ``user`` (None:
    nobody in particular). ``run_id(row)`` names a row's run; rows are read and masked by chunk, the
    maskers rebuilt per chunk (two queries), so memory stays bounded whatever the range.
    Rows are dicts (``.values()``) or objects; they are masked in place."""
    batch: list[Any] = []
    for row in rows:
        batch.append(row)
        if len(batch) >= chunk_size:
            yield from _mask_batch(batch, run_id, fields, user)
            batch = []
    if batch:
        yield from _mask_batch(batch, run_id, fields, user)


def _mask_batch(batch: list[Any], run_id: Any, fields: tuple[str, ...], user: Any) -> Iterator[Any]:
    masks = maskers_for_ids({run_id(row) for row in batch}, user=user)
    for row in batch:
        mask = masks.get(run_id(row), UNMASKED)
        for name in fields:
            if isinstance(row, dict):
                row[name] = mask(row[name])
            else:
                setattr(row, name, mask(getattr(row, name)))
        yield row

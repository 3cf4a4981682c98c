"""Template helpers for the console: relative times with the absolute time beside them, and
what a viewer may see of a run's sensitive values."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from django import template
from django.urls import reverse
from django.utils import timezone
from django.utils.formats import date_format
from django.utils.html import format_html
from django.utils.safestring import SafeString
from django.utils.timesince import timesince, timeuntil

from runs.masking import Masker
from runs.registry import argument_rows, call_summary

register = template.Library()


def _relative(value: datetime, now: datetime) -> str:
    if abs((now - value).total_seconds()) < 45:
        return "just now"
    if value <= now:
        return timesince(value, now, depth=1) + " ago"
    return "in " + timeuntil(value, now, depth=1)


@register.filter(name="ago", expects_localtime=False)
def ago(value: datetime | None) -> SafeString | str:
    """``<time>`` with "3 minutes ago" as text, and the absolute time in the operator's
    timezone (the middleware activates it) in the title: the relative form answers "how
    long", the title answers "when exactly" during an incident review."""
    if not value:
        return "—"
    local = timezone.localtime(value)
    absolute = date_format(local, "Y-m-d H:i:s T")
    return format_html(
        '<time datetime="{}" title="{}">{}</time>',
        value.isoformat(),
        absolute,
        _relative(value, timezone.now()),
    )


@register.filter(name="localstamp", expects_localtime=False)
def localstamp(value: datetime | None) -> SafeString | str:
    """The absolute time in the operator's timezone, in a ``<time>`` element."""
    if not value:
        return "—"
    local = timezone.localtime(value)
    return format_html(
        '<time datetime="{}">{}</time>', value.isoformat(), date_format(local, "Y-m-d H:i:s T")
    )


@register.filter(name="call_summary")
def call_summary_filter(value: Any, shown_arguments: Any = None) -> str:
    """One line that says what a call (a ``ToolCall`` or an ``Approval``) does, from its
    masked arguments (``runs.registry.call_summary``) — or from ``shown_arguments``, the
    arguments as this viewer may see them (sensitive tool output masked: runs.masking)."""
    arguments = value.arguments_masked if shown_arguments is None else shown_arguments
    return call_summary(value.tool_name, arguments)


@register.filter(name="shortid")
def shortid(value: object) -> str:
    """The first 8 hex digits of a UUID: what operators read aloud and type into search."""
    return str(value)[:8]


@register.filter(name="masked")
def masked(value: Any, masker: Masker) -> Any:
    """``value`` as this viewer may see it: sensitive tool output masked (runs.masking). The
    view puts the run's masker in the context as ``mask``; without one this fails rather
    than show the values."""
    if not isinstance(masker, Masker):
        raise TypeError("masked: the context has no masker for this run")
    return masker(value)


@register.filter(name="masked_result")
def masked_result(call: Any, masker: Masker) -> Any:
    """A tool call's receipt result as this viewer may see it (its declared paths too)."""
    if not isinstance(masker, Masker):
        raise TypeError("masked_result: the context has no masker for this run")
    return masker.output(call.tool_name, call.receipt.result)


RUN_GOAL_SHOWN = 60  # characters of the goal in a run's name


def run_label(agent_name: str, goal: str, run_id: object) -> str:
    """How a run is named to people: agent, goal (its start) and short id — "refund · Refund
    order ord_1004 · 3fa2b1c4" — never a bare hex id."""
    goal = " ".join(str(goal or "").split())
    if len(goal) > RUN_GOAL_SHOWN:
        goal = goal[: RUN_GOAL_SHOWN - 1] + "…"
    return " · ".join(part for part in (agent_name, goal, shortid(run_id)) if part)


@register.filter(name="run_name")
def run_name(run: Any) -> str:
    """A ``Run``'s name for people (``run_label``); the query must have loaded its agent
    name and goal."""
    return run_label(run.agent_name, run.goal, run.id)


@register.simple_tag(name="run_link")
def run_link(
    run: Any = None,
    *,
    run_id: Any = None,
    agent: str = "",
    goal: str = "",
    dry_run: bool = False,
    badge: bool = True,
) -> str:
    """A link to a run's page named by ``run_label``: ``{% run_link run %}``, or from the
    parts ``{% run_link run_id=item.run_id agent=item.run_agent goal=item.run_goal %}``.
    A dry run's link carries its badge wherever a run is linked (``badge=False`` where the
    page shows it already)."""
    if run is not None:
        run_id, agent, goal = run.id, run.agent_name, run.goal
        # a run loaded with only some fields: its badge only when ``dry_run`` was loaded
        # (never a query per link)
        deferred = run.get_deferred_fields() if hasattr(run, "get_deferred_fields") else ()
        dry_run = "dry_run" not in deferred and bool(getattr(run, "dry_run", False))
    link = format_html(
        '<a class="run-link" href="{}" title="run {}">{}</a>',
        reverse("runs:detail", args=[run_id]),
        run_id,
        run_label(agent, goal, run_id),
    )
    if dry_run and badge:
        link = format_html(
            '{} <span class="badge badge-dry-run" title="a dry run: its tools with side '
            'effects are only simulated">dry run</span>',
            link,
        )
    return link


@register.filter(name="argument_rows")
def argument_rows_filter(value: Any, shown_arguments: Any = None) -> list[tuple[str, str]]:
    """A call's (``ToolCall``, ``Approval``) arguments as rows of a table, money with its
    currency (``runs.registry.argument_rows``), from ``shown_arguments`` — the arguments as
    this viewer may see them — or its masked arguments."""
    arguments = value.arguments_masked if shown_arguments is None else shown_arguments
    return argument_rows(value.tool_name, arguments)

"""List filters that need no ``SELECT DISTINCT`` over big tables: choices from the catalogues
and the registry, or fixed values."""

from __future__ import annotations

from django.contrib import admin
from django.db.models import Q

from runs.models import AgentManifest, RunEvent
from runs.record.eventtypes import EventType


class ActorKindFilter(admin.SimpleListFilter):
    """By kind of actor: a fixed list, so no ``SELECT DISTINCT actor`` over every event."""

    title = "actor"
    parameter_name = "actor_kind"

    def lookups(self, request, model_admin):
        return [
            ("user", "people (user:…)"),
            ("worker", "workers (worker:…)"),
            ("system", "system"),
            ("other", "other"),
        ]

    def queryset(self, request, queryset):
        value = self.value()
        if value in ("user", "worker"):
            return queryset.filter(actor__startswith=f"{value}:")
        if value == "system":
            return queryset.filter(actor="system")
        if value == "other":
            return queryset.exclude(
                Q(actor__startswith="user:") | Q(actor__startswith="worker:") | Q(actor="system")
            )
        return queryset


class EventTypeFilter(admin.SimpleListFilter):
    title = "type"
    parameter_name = "type"

    def lookups(self, request, model_admin):
        return sorted(EventType.choices)

    def queryset(self, request, queryset):
        return queryset.filter(type=self.value()) if self.value() else queryset


def _registered_names(kind: str) -> list[str]:
    """Agent or tool names from the registry (hosted) and the manifests (remote): the filter
    choices, without a ``SELECT DISTINCT`` over every run or call."""
    from runs.registry import registry

    if kind == "agent":
        names = {agent.name for agent in registry.agents()}
        names.update(AgentManifest.objects.values_list("name", flat=True))
    else:
        names = {tool.name for tool in registry.tools()}
        names.update(
            tool.get("name", "")
            for tools in AgentManifest.objects.values_list("tools", flat=True)
            for tool in (tools or [])
            if isinstance(tool, dict)
        )
    return sorted(name for name in names if name)


class AgentFilter(admin.SimpleListFilter):
    title = "agent"
    parameter_name = "agent"

    def lookups(self, request, model_admin):
        return [(name, name) for name in _registered_names("agent")]

    def queryset(self, request, queryset):
        return queryset.filter(agent_name=self.value()) if self.value() else queryset


class ToolFilter(admin.SimpleListFilter):
    """By tool, from the registry and manifests (no DISTINCT over every tool call)."""

    title = "tool"
    parameter_name = "tool"
    field_path = "tool_name"

    def lookups(self, request, model_admin):
        return [(name, name) for name in _registered_names("tool")]

    def queryset(self, request, queryset):
        if not self.value():
            return queryset
        return queryset.filter(**{self.field_path: self.value()})


class ReceiptToolFilter(ToolFilter):
    field_path = "tool_call__tool_name"


class FixedChoicesFilter(admin.SimpleListFilter):
    """A filter over a column whose values are a known, small set (channels, effects): the
    choices come from code, not from a ``SELECT DISTINCT`` over the table."""

    field_path = ""
    values: tuple[str, ...] = ()

    def lookups(self, request, model_admin):
        return [(value, value) for value in self.values]

    def queryset(self, request, queryset):
        if not self.value():
            return queryset
        return queryset.filter(**{self.field_path: self.value()})


class ChannelFilter(FixedChoicesFilter):
    title = "channel"
    parameter_name = "channel"
    field_path = "channel"
    values = tuple(RunEvent.Channel.values)


class EffectFilter(FixedChoicesFilter):
    title = "effect"
    parameter_name = "effect"
    field_path = "effect"
    values = ("read", "idempotent", "reconcilable", "unsafe")

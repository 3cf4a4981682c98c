"""Console pages for approval policies (docs/console.md, "Approval policies"): the list of
tools and their policies, a policy's versions, a version with its diff and simulation, and
the draft form. Reading needs ``approvals.view_approvalpolicy`` (admins, auditors); drafting,
simulating, publishing and discarding go through ``approvals.policy_services``, which checks
``approvals.manage_approvalpolicy`` (admins) and the separation of duties. Every change is a
POST with CSRF."""

from __future__ import annotations

import difflib
import json
from dataclasses import dataclass
from typing import Any
from zoneinfo import available_timezones

from django import forms
from django.contrib import messages
from django.contrib.auth.decorators import login_required, permission_required
from django.contrib.auth.models import Group
from django.forms import formset_factory
from django.http import HttpRequest, HttpResponse
from django.shortcuts import get_object_or_404, redirect, render
from django.views.decorators.http import require_POST

from approvals import policies
from approvals.models import ApprovalPolicy, ApprovalPolicyVersion
from approvals.policy_services import (
    MANAGE,
    SIMULATE_MAX_CALLS,
    SIMULATE_MAX_DAYS,
    Change,
    PolicyConflict,
    PolicyInvalid,
    policy_simulate,
    policy_version_discard,
    policy_version_draft,
    policy_version_publish,
    policy_withdraw,
)
from runs.actors import Actor, PermissionDenied
from runs.forms import choice_field
from runs.registry import Effect, registry
from runs.services import InvalidInput
from runs.views import HtmxHttpRequest

VIEW = "approvals.view_approvalpolicy"


def _can_manage(request: HttpRequest) -> bool:
    return request.user.has_perm(MANAGE)


# --- the list ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class PolicyRow:
    """A policy on the list, with its version in force and how many drafts wait."""

    policy: ApprovalPolicy
    current: ApprovalPolicyVersion | None
    drafts: int


@login_required
@permission_required(VIEW, raise_exception=True)
def policy_list(request: HttpRequest) -> HttpResponse:
    policies_by_tool: dict[str, list[PolicyRow]] = {}
    current = {
        v.policy_id: v
        for v in ApprovalPolicyVersion.objects.filter(
            status=ApprovalPolicyVersion.Status.PUBLISHED
        ).select_related("published_by")
    }
    drafts: dict[int, int] = {}
    for policy_id in ApprovalPolicyVersion.objects.filter(
        status=ApprovalPolicyVersion.Status.DRAFT
    ).values_list("policy_id", flat=True):
        drafts[policy_id] = drafts.get(policy_id, 0) + 1
    for policy in ApprovalPolicy.objects.all():
        row = PolicyRow(
            policy=policy, current=current.get(policy.id), drafts=drafts.get(policy.id, 0)
        )
        policies_by_tool.setdefault(policy.tool_name, []).append(row)
    tools = []
    for tool in registry.tools():
        if tool.effect == Effect.READ and tool.name not in policies_by_tool:
            continue  # a read with no policy has nothing to govern
        tools.append(
            {
                "name": tool.name,
                "effect": str(tool.effect),
                "code_policy": _code_policy(tool),
                "policies": policies_by_tool.pop(tool.name, []),
            }
        )
    # policies of tools no longer registered (or remote tools) stay visible
    for name, items in sorted(policies_by_tool.items()):
        tools.append({"name": name, "effect": "", "code_policy": "", "policies": items})
    return render(
        request,
        "approvals/policies.html",
        {"tools": tools, "can_manage": _can_manage(request)},
    )


def _code_policy(tool: Any) -> str:
    code = tool.approval
    if code.when == "never":
        return "never needs approval"
    who = "1 approver" if code.required == 1 else f"{code.required} approvers"
    return f"{code.describe()}: {who} from {code.group}"


# --- a policy ----------------------------------------------------------------------------------


@login_required
@permission_required(VIEW, raise_exception=True)
def policy_detail(request: HttpRequest, policy_id: int) -> HttpResponse:
    policy = get_object_or_404(ApprovalPolicy, id=policy_id)
    versions = list(
        policy.versions.select_related("created_by", "published_by").order_by("-number")
    )
    current = next((v for v in versions if v.status == "published"), None)
    return render(
        request,
        "approvals/policy.html",
        {
            "policy": policy,
            "versions": versions,
            "current": current,
            "current_rule_rows": _rule_rows(current.rules) if current is not None else [],
            "withdrawal_pending": any(v.withdraws and v.status == "draft" for v in versions),
            "can_manage": _can_manage(request),
        },
    )


class WithdrawForm(forms.Form):
    note = forms.CharField(
        max_length=2000,
        widget=forms.Textarea(attrs={"rows": 2}),
        label="Why (recorded with the withdrawal)",
    )
    based_on = forms.IntegerField(required=False, widget=forms.HiddenInput)


@login_required
@require_POST
def policy_withdraw_view(request: HttpRequest, policy_id: int) -> HttpResponse:
    """Draft the policy's withdrawal (another admin publishes it, like any version)."""
    policy = get_object_or_404(ApprovalPolicy, id=policy_id)
    form = WithdrawForm(request.POST)
    if not form.is_valid():
        messages.error(
            request,
            "Nothing was withdrawn: "
            + " ".join(str(m) for m in form.errors.get("note", ["say why"])),
        )
        return redirect("approvals:policy", policy_id=policy.id)
    try:
        version = policy_withdraw(
            actor=Actor.for_user(request.user, "web"),
            policy_id=policy.id,
            note=form.cleaned_data["note"],
            based_on=form.cleaned_data.get("based_on"),
        )
    except PermissionDenied as exc:
        return HttpResponse(str(exc), status=403)
    except (PolicyConflict, PolicyInvalid) as exc:
        messages.error(request, f"Nothing was withdrawn: {exc}")
        return redirect("approvals:policy", policy_id=policy.id)
    messages.success(
        request,
        f"Withdrawal drafted as version {version.number}. Simulate it, then ask another admin "
        "to publish it: until then the current version stays in force.",
    )
    return redirect("approvals:policy_version", version_id=version.id)


def _rule_rows(rules: list[dict[str, Any]]) -> list[dict[str, Any]]:
    rows = []
    for index, rule in enumerate(rules, start=1):
        decision = rule.get("decide", "allow")
        detail = ""
        if decision == "require_approval":
            req = policies.Requirement.from_rule(rule.get("approval"))
            detail = req.describe()
            detail += f", expires after {_duration(req.ttl_seconds)}, then {req.on_expiry}"
            if req.on_expiry == "escalate":
                detail += f" to {req.escalate_to}"
            if req.bearer_links:
                detail += ", the emailed link alone decides"
        elif decision == "deny":
            detail = rule.get("reason") or ""
        rows.append(
            {
                "index": index,
                "when": rule.get("when") or "always",
                "decide": decision,
                "detail": detail,
            }
        )
    return rows


def _duration(seconds: int) -> str:
    if seconds % 86400 == 0:
        days = seconds // 86400
        return f"{days} day{'s' if days != 1 else ''}"
    if seconds % 3600 == 0:
        hours = seconds // 3600
        return f"{hours} hour{'s' if hours != 1 else ''}"
    return f"{seconds // 60} minutes"


# --- a version: rules, diff, simulation, publish --------------------------------------------


def _document(version: ApprovalPolicyVersion | None) -> list[str]:
    if version is None:
        return []
    document: dict[str, Any] = {"time_zone": version.time_zone, "rules": version.rules}
    if version.withdraws:
        # a withdrawal's one difference that is not in its (empty) rules
        document["withdraws"] = True
    text = json.dumps(document, indent=2, sort_keys=True)
    return text.splitlines()


def version_diff(old: ApprovalPolicyVersion | None, new: ApprovalPolicyVersion) -> list[tuple]:
    """Line by line: (kind, text) with kind ``add``, ``del``, ``same`` or ``hunk``."""
    lines = []
    old_label = f"v{old.number}" if old else "(none)"
    for line in difflib.unified_diff(
        _document(old), _document(new), old_label, f"v{new.number}", lineterm="", n=3
    ):
        if line.startswith(("---", "+++")):
            continue
        if line.startswith("@@"):
            lines.append(("hunk", line))
        elif line.startswith("+"):
            lines.append(("add", line))
        elif line.startswith("-"):
            lines.append(("del", line))
        else:
            lines.append(("same", line))
    return lines


@login_required
@permission_required(VIEW, raise_exception=True)
def version_detail(request: HttpRequest, version_id: int) -> HttpResponse:
    version = get_object_or_404(
        ApprovalPolicyVersion.objects.select_related(
            "policy", "created_by", "published_by", "based_on"
        ),
        id=version_id,
    )
    others = list(version.policy.versions.exclude(id=version.id).order_by("-number"))
    against_id = request.GET.get("against", "")
    against = next((v for v in others if str(v.id) == against_id), None)
    if against is None:
        against = version.based_on or next((v for v in others if v.number < version.number), None)
    context = {
        "version": version,
        "policy": version.policy,
        "rule_rows": _rule_rows(version.rules),
        "others": others,
        "against": against,
        "diff": version_diff(against, version),
        "can_manage": _can_manage(request),
        "is_drafter": version.created_by_id == request.user.pk,
        "max_days": SIMULATE_MAX_DAYS,
        "simulation_limit": SIMULATE_MAX_CALLS,
        "labels": Change.LABELS,
    }
    return render(request, "approvals/policy_version.html", context)


@login_required
@require_POST
def version_simulate(request: HtmxHttpRequest, version_id: int) -> HttpResponse:
    version = get_object_or_404(
        ApprovalPolicyVersion.objects.select_related("policy"), id=version_id
    )
    error = ""
    simulation = None
    try:
        days = int(request.POST.get("days", "7"))
    except ValueError:
        days = 0
    try:
        simulation = policy_simulate(
            actor=Actor.for_user(request.user, "web"), version_id=version.id, days=days
        )
    except PermissionDenied as exc:
        return HttpResponse(str(exc), status=403)
    except InvalidInput as exc:
        error = str(exc)
    context: dict[str, Any] = {
        "version": version,
        "policy": version.policy,
        "simulation": simulation,
        "error": error,
        "days": days,
        "max_days": SIMULATE_MAX_DAYS,
        "simulation_limit": SIMULATE_MAX_CALLS,
        "labels": Change.LABELS,
        "can_manage": _can_manage(request),
    }
    template = "approvals/policy_version.html#simulation" if request.htmx else None
    if template is None:
        # without htmx: the whole page, with the results in it
        context.update(
            {
                "policy": version.policy,
                "rule_rows": _rule_rows(version.rules),
                "others": list(version.policy.versions.exclude(id=version.id)),
                "against": version.based_on,
                "diff": version_diff(version.based_on, version),
                "is_drafter": version.created_by_id == request.user.pk,
            }
        )
        template = "approvals/policy_version.html"
    return render(request, template, context, status=400 if error else 200)


@login_required
@require_POST
def version_publish(request: HttpRequest, version_id: int) -> HttpResponse:
    version = get_object_or_404(ApprovalPolicyVersion, id=version_id)
    try:
        published, done = policy_version_publish(
            actor=Actor.for_user(request.user, "web"), version_id=version.id, request=request
        )
    except PermissionDenied as exc:
        messages.error(request, str(exc))
        return redirect("approvals:policy_version", version_id=version.id)
    except (PolicyConflict, PolicyInvalid) as exc:
        messages.error(request, str(exc))
        return redirect("approvals:policy_version", version_id=version.id)
    summary = f"Version {published.number} is now the policy for {published.policy.tool_name}."
    if published.withdraws:
        summary = (
            f"Version {published.number} withdrew the policy for "
            f"{published.policy.tool_name}{published.policy.scope_label}: the tool's code "
            "policy (or a broader data policy) applies."
        )
    if done.rerequested:
        summary += f" {len(done.rerequested)} pending approval(s) asked again under it."
    if done.denied:
        summary += f" {len(done.denied)} pending call(s) rejected: the new rules deny them."
    if done.still_pending:
        summary += (
            f" {len(done.still_pending)} pending approval(s) still wait for a decision "
            "(a looser policy never approves by itself)."
        )
    messages.success(request, summary)
    return redirect("approvals:policy", policy_id=published.policy_id)


@login_required
@require_POST
def version_discard(request: HttpRequest, version_id: int) -> HttpResponse:
    version = get_object_or_404(ApprovalPolicyVersion, id=version_id)
    try:
        policy_version_discard(actor=Actor.for_user(request.user, "web"), version_id=version.id)
    except PermissionDenied as exc:
        return HttpResponse(str(exc), status=403)
    except PolicyConflict as exc:
        messages.error(request, str(exc))
        return redirect("approvals:policy_version", version_id=version.id)
    messages.success(request, f"Draft version {version.number} discarded.")
    return redirect("approvals:policy", policy_id=version.policy_id)


# --- the draft form ----------------------------------------------------------------------------


def _group_choices() -> list[tuple[str, str]]:
    return [(name, name) for name in Group.objects.order_by("name").values_list("name", flat=True)]


class RuleForm(forms.Form):
    when = forms.CharField(
        required=False,
        max_length=policies.MAX_EXPRESSION,
        label="When (CEL)",
        help_text="Empty: always. e.g. args.amount_cents > 5000",
        widget=forms.TextInput(attrs={"class": "code", "spellcheck": "false"}),
    )
    decide = forms.ChoiceField(
        choices=[
            ("", "—"),
            ("allow", "allow"),
            ("require_approval", "require approval"),
            ("deny", "deny"),
        ],
        required=False,
        label="Decision",
    )
    reason = forms.CharField(
        required=False, max_length=500, label="Reason (deny: the agent sees it)"
    )
    group = forms.ChoiceField(required=False, label="Approvers from")
    required = forms.IntegerField(
        required=False, min_value=1, max_value=policies.MAX_REQUIRED, label="Approvers needed"
    )
    from_groups = forms.CharField(
        required=False,
        max_length=500,
        label="Of whom at least",
        help_text="e.g. finance=1 (members of these groups may approve too; "
        "each approver counts for one group)",
        widget=forms.TextInput(attrs={"class": "code", "spellcheck": "false"}),
    )
    ttl_hours = forms.IntegerField(
        required=False,
        min_value=1,
        max_value=policies.MAX_TTL // 3600,
        label="Expires after (hours)",
    )
    on_expiry = forms.ChoiceField(
        required=False, choices=[(c, c) for c in policies.ON_EXPIRY], label="On expiry"
    )
    escalate_to = forms.ChoiceField(required=False, label="Escalate to")
    bearer_links = forms.BooleanField(
        required=False, label="The emailed link alone decides (1 approver only)"
    )

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        groups = _group_choices()
        choice_field(self, "group").choices = groups
        choice_field(self, "escalate_to").choices = [("", "—"), *groups]

    def clean_from_groups(self) -> dict[str, int]:
        """ "finance=1, legal=1" -> {"finance": 1, "legal": 1} (the policy validates the
        groups and the sum)."""
        text = (self.cleaned_data.get("from_groups") or "").strip()
        minimums: dict[str, int] = {}
        for part in filter(None, (p.strip() for p in text.replace(";", ",").split(","))):
            name, sep, count = part.partition("=")
            name, count = name.strip(), count.strip()
            if not sep or not name or not count.isdigit() or int(count) < 1:
                raise forms.ValidationError(
                    f"Write each group as name=number, e.g. finance=1 (not {part!r})."
                )
            if name in minimums:
                raise forms.ValidationError(f"{name} is named twice.")
            minimums[name] = int(count)
        return minimums

    def rule(self) -> dict[str, Any] | None:
        data = self.cleaned_data
        if not data.get("decide"):
            return None  # a blank row: no rule
        rule: dict[str, Any] = {"when": (data.get("when") or "").strip(), "decide": data["decide"]}
        if data["decide"] == "deny" and data.get("reason"):
            rule["reason"] = data["reason"]
        if data["decide"] == "require_approval":
            spec: dict[str, Any] = {
                "group": data.get("group") or "approver",
                "required": data.get("required") or 1,
                "ttl_seconds": (data.get("ttl_hours") or 24) * 3600,
                "on_expiry": data.get("on_expiry") or "reject",
            }
            if data.get("from_groups"):
                spec["from_groups"] = data["from_groups"]
            if data.get("escalate_to"):
                spec["escalate_to"] = data["escalate_to"]
            if data.get("bearer_links"):
                spec["bearer_links"] = True
            rule["approval"] = spec
        return rule

    @staticmethod
    def initial_for(rule: dict[str, Any]) -> dict[str, Any]:
        spec = rule.get("approval") or {}
        return {
            "when": rule.get("when", ""),
            "decide": rule.get("decide", ""),
            "reason": rule.get("reason", ""),
            "group": spec.get("group", "approver"),
            "required": spec.get("required", 1),
            "from_groups": ", ".join(
                f"{g}={n}" for g, n in sorted(policies.minimums_of(spec).items())
            ),
            "ttl_hours": max(1, int(spec.get("ttl_seconds", policies.DEFAULT_TTL)) // 3600),
            "on_expiry": spec.get("on_expiry", "reject"),
            "escalate_to": spec.get("escalate_to", ""),
            "bearer_links": bool(spec.get("bearer_links", False)),
        }


RuleFormSet = formset_factory(
    RuleForm, extra=1, max_num=policies.MAX_RULES, absolute_max=policies.MAX_RULES
)


class DraftForm(forms.Form):
    tool = forms.ChoiceField(label="Tool")
    agent_name = forms.ChoiceField(required=False, label="Only for agent")
    principal_group = forms.ChoiceField(required=False, label="Only for principals in")
    time_zone = forms.ChoiceField(label="Time zone (for now.hour, now.weekday…)")
    note = forms.CharField(
        max_length=2000,
        widget=forms.Textarea(attrs={"rows": 2}),
        label="Why (recorded with the version)",
    )

    def __init__(self, *args: Any, fixed_scope: bool = False, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        choice_field(self, "tool").choices = [(t.name, t.name) for t in registry.tools()]
        choice_field(self, "agent_name").choices = [("", "every agent")] + [
            (a.name, a.name) for a in registry.agents()
        ]
        choice_field(self, "principal_group").choices = [("", "every principal"), *_group_choices()]
        choice_field(self, "time_zone").choices = [("UTC", "UTC")] + [
            (z, z) for z in sorted(available_timezones()) if z != "UTC" and "/" in z
        ]
        if fixed_scope:
            for name in ("tool", "agent_name", "principal_group"):
                self.fields[name].disabled = True


def _unchecked(form: forms.Form, formset: Any) -> None:
    """Show what was typed without judging it yet (the "Add a rule" round trip)."""
    from django.forms.utils import ErrorDict, ErrorList

    # Django's cache of a bound form's errors (not in django-stubs): empty, the form renders
    # what was typed without validating it
    form._errors = ErrorDict()  # type: ignore[attr-defined]
    for item in formset.forms:
        item._errors = ErrorDict()
    formset._errors = [ErrorDict() for _ in formset.forms]
    formset._non_form_errors = ErrorList()


def _rules_with_rows(formset: Any) -> tuple[list[dict[str, Any]], list[int]]:
    """The rules the formset holds and, for each, the index of its row (rule N's errors
    are shown on its row)."""
    rules, rows = [], []
    for index, form in enumerate(formset.forms):
        rule = form.rule()
        if rule is not None:
            rules.append(rule)
            rows.append(index)
    return rules, rows


@login_required
@permission_required(VIEW, raise_exception=True)
def policy_draft(request: HttpRequest) -> HttpResponse:
    """A new draft: of an existing policy (``?policy=``, its current or a given version as
    the start, ``?from=``), or of a new policy for a tool (``?tool=``)."""
    if not _can_manage(request):
        return HttpResponse("drafting policies needs the admin role", status=403)
    policy = None
    start = None
    source = request.GET if request.method == "GET" else request.POST
    policy_id = source.get("policy")
    if policy_id:
        policy = get_object_or_404(ApprovalPolicy, id=policy_id)
        versions = policy.versions.all()
        start_id = source.get("from")
        start = (
            versions.filter(id=start_id).first()
            if start_id
            else versions.filter(status="published").first() or versions.order_by("-number").first()
        )
        if start is not None and start.withdraws:
            # a withdrawn policy is drafted again from its last rules, not from none
            start = versions.filter(withdraws=False).order_by("-number").first() or start
    initial = {
        "tool": policy.tool_name if policy else source.get("tool", ""),
        "agent_name": policy.agent_name if policy else "",
        "principal_group": policy.principal_group if policy else "",
        "time_zone": start.time_zone if start else "UTC",
    }
    current = policy.versions.filter(status="published").first() if policy else None
    error = ""
    if request.method == "POST" and "add_rule" in request.POST:
        # "Add a rule": the same form again with one more empty row (nothing is saved)
        data = request.POST.copy()
        total = int(data.get("rules-TOTAL_FORMS") or 0)
        data["rules-TOTAL_FORMS"] = str(min(total + 1, policies.MAX_RULES))
        form = DraftForm(data, initial=initial, fixed_scope=policy is not None)
        formset = RuleFormSet(data, prefix="rules")
        _unchecked(form, formset)
    elif request.method == "POST":
        form = DraftForm(request.POST, initial=initial, fixed_scope=policy is not None)
        formset = RuleFormSet(request.POST, prefix="rules")
        if form.is_valid() and formset.is_valid():
            rules, rows = _rules_with_rows(formset)
            based_on = request.POST.get("based_on") or None
            try:
                version = policy_version_draft(
                    actor=Actor.for_user(request.user, "web"),
                    tool_name=form.cleaned_data["tool"],
                    agent_name=form.cleaned_data["agent_name"],
                    principal_group=form.cleaned_data["principal_group"],
                    time_zone=form.cleaned_data["time_zone"],
                    note=form.cleaned_data["note"],
                    rules=rules,
                    based_on=int(based_on) if based_on else None,
                )
            except PolicyInvalid as exc:
                for where, msgs in exc.fields.items():
                    if where.startswith("rule "):
                        number = int(where.split()[1])
                        formset.forms[rows[number - 1]].add_error(None, " ".join(msgs))
                    elif where in form.fields:
                        form.add_error(where, " ".join(msgs))
                    else:
                        form.add_error(None, f"{where}: {' '.join(msgs)}")
                error = "The draft was not saved: fix the rules marked below."
            except PolicyConflict as exc:
                error = str(exc)
            except PermissionDenied as exc:
                return HttpResponse(str(exc), status=403)
            else:
                messages.success(
                    request,
                    f"Draft version {version.number} saved. Simulate it against recent calls, "
                    "then ask another admin to publish it.",
                )
                return redirect("approvals:policy_version", version_id=version.id)
        else:
            error = "The draft was not saved: fix the fields marked below."
    else:
        form = DraftForm(initial=initial, fixed_scope=policy is not None)
        rules = start.rules if start else []
        formset = RuleFormSet(prefix="rules", initial=[RuleForm.initial_for(r) for r in rules])
    # the form shown again with its errors is a page like any other (Django's FormView
    # answers 200 too): the API answers 400 validation_error for the same rules
    status = 200
    return render(
        request,
        "approvals/policy_draft.html",
        {
            "form": form,
            "formset": formset,
            "policy": policy,
            "start": start,
            "current": current,
            "error": error,
            "names": policies.NAMES,
        },
        status=status,
    )

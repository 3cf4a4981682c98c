"""A tool's fingerprint (``Tool.version``, recorded as ``ToolCall.tool_version``): it changes
with what the tool does, not with where its code sits, and it is the same in every process."""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

from runs.registry import (
    ApprovalPolicy,
    Effect,
    OnExpiry,
    Tool,
    ToolResult,
    argument_rows,
    call_summary,
    money,
    registry,
)
from tests.support import CountingTool

SCHEMA = {"type": "object", "properties": {"amount": {"type": "integer"}}}


def _tool(call, **overrides) -> Tool:
    return Tool(
        **{"name": "fp_charge", "effect": Effect.IDEMPOTENT, "call": call, "schema": SCHEMA}
        | overrides
    )


def _compiled(source: str, name: str, *, line: int = 1, filename: str = "tools_a.py", **env):
    """``name`` defined by ``source`` as if it began at ``line`` of ``filename``."""
    namespace = {"__name__": filename.removesuffix(".py"), "ToolResult": ToolResult, **env}
    exec(compile("\n" * (line - 1) + textwrap.dedent(source), filename, "exec"), namespace)
    return namespace[name]


CHARGE = """
    def charge(arguments, ctx):
        '''Charge the amount.'''
        return ToolResult({"charged": arguments["amount"]})
"""


def test_moving_a_function_keeps_its_fingerprint():
    here = _compiled(CHARGE, "charge")
    moved = _compiled(CHARGE, "charge", line=140, filename="elsewhere/billing.py")
    renamed = _compiled(CHARGE.replace("def charge", "def take_payment"), "take_payment")
    redocumented = _compiled(CHARGE.replace("Charge the amount.", "Takes money."), "charge")

    assert here.__code__.co_firstlineno != moved.__code__.co_firstlineno
    assert (
        _tool(here).version
        == _tool(moved).version
        == _tool(renamed).version
        == _tool(redocumented).version
    )


def test_a_behaviour_change_is_a_new_fingerprint():
    before = _tool(_compiled(CHARGE, "charge"))
    after = _tool(
        _compiled(CHARGE.replace('arguments["amount"]', 'arguments["amount"] * 100'), "charge")
    )

    assert before.version != after.version
    assert len(before.version) == 16 and int(before.version, 16) >= 0


def test_a_helper_and_a_constant_of_the_module_count():
    source = """
        LIMIT = {limit}

        def _cents(amount):
            return amount * {factor}

        def charge(arguments, ctx):
            return ToolResult({{"charged": min(_cents(arguments["amount"]), LIMIT)}})
    """

    def version(limit: int, factor: int) -> str:
        return _tool(_compiled(source.format(limit=limit, factor=factor), "charge")).version

    assert version(150, 1) == version(150, 1)
    assert version(150, 1) != version(15000, 1)  # the constant
    assert version(150, 1) != version(150, 100)  # the helper's code


def test_a_removed_precondition_is_a_new_fingerprint():
    charge = _compiled(CHARGE, "charge")
    guarded = _tool(charge, precondition=lambda arguments: f"balance={arguments['amount']}")

    assert _tool(charge).version != guarded.version
    same = _tool(charge, precondition=lambda arguments: f"balance={arguments['amount']}")
    other = _tool(charge, precondition=lambda arguments: f"owner={arguments['amount']}")
    assert same.version == guarded.version != other.version


def test_the_approval_policy_counts_with_its_predicate_code():
    charge = _compiled(CHARGE, "charge")
    large = _compiled("def large(arguments):\n    return arguments['amount'] > 150\n", "large")
    larger = _compiled("def large(arguments):\n    return arguments['amount'] > 15000\n", "large")
    base = _tool(charge, approval=ApprovalPolicy(when=large)).version

    assert base == _tool(charge, approval=ApprovalPolicy(when=large)).version
    variants = [
        ApprovalPolicy(when=larger),
        ApprovalPolicy(when="always"),
        ApprovalPolicy(when=large, group="operator"),
        ApprovalPolicy(when=large, required=2),
        ApprovalPolicy(when=large, ttl_seconds=60),
        ApprovalPolicy(when=large, on_expiry=OnExpiry.TERMINATE),
    ]
    versions = {_tool(charge, approval=policy).version for policy in variants}
    assert base not in versions and len(versions) == len(variants)


def test_schema_effect_reconcile_and_declared_version_count_but_not_timeout_or_groups():
    charge = _compiled(CHARGE, "charge")
    base = _tool(charge)

    assert _tool(charge, schema={"type": "object"}).version != base.version
    assert _tool(charge, effect=Effect.UNSAFE).version != base.version
    assert _tool(charge, reconcile=lambda key, arguments: None).version != base.version
    assert _tool(charge, sensitive_fields=("amount",)).version != base.version
    declared = _tool(charge, version="2")
    assert declared.version != base.version and declared.declared_version == "2"
    assert _tool(charge, version="3").version != declared.version
    same = [
        _tool(charge, timeout=30.0),
        _tool(charge, allowed_groups=("operator",)),
        _tool(charge, description="Charges a card."),
    ]
    assert {tool.version for tool in same} == {base.version}


def test_closure_values_partials_and_callable_objects_count_by_value_and_code():
    def capped(limit):
        def charge(arguments, ctx):
            return ToolResult({"charged": min(arguments["amount"], limit)})

        return charge

    assert _tool(capped(150)).version == _tool(capped(150)).version
    assert _tool(capped(150)).version != _tool(capped(15000)).version

    def charge_in(arguments, ctx, *, currency):
        return ToolResult({"charged": arguments["amount"], "currency": currency})

    eur = _tool(functools.partial(charge_in, currency="EUR")).version
    assert eur == _tool(functools.partial(charge_in, currency="EUR")).version
    assert eur != _tool(functools.partial(charge_in, currency="USD")).version

    # a callable object: its class's code and its plain attributes; what it has recorded
    # (a list of calls) is state, not behaviour
    body = CountingTool()
    before = _tool(body).version
    body.calls.append({"arguments": {}, "key": "k"})
    assert _tool(body).version == before
    assert _tool(CountingTool(lambda a, c: None)).version != before


def test_compatible_with_accepts_the_listed_fingerprints_only():
    old = _tool(_compiled(CHARGE, "charge"))
    new_code = _compiled(CHARGE.replace("charged", "paid"), "charge")
    new = _tool(new_code, compatible_with=[old.version])

    assert new.version != old.version
    assert new.compatible_with == (old.version,)
    assert new.accepts(new.version) and new.accepts(old.version)
    assert not new.accepts("0123456789abcdef")
    assert not _tool(new_code).accepts(old.version)
    assert new.version == _tool(new_code).version  # the list is not part of the fingerprint


def test_a_fingerprint_is_the_same_in_every_process(tmp_path):
    """Workers recover each other's runs: a fingerprint that depended on the process (an
    id, a str hash, an address in a repr) would make every recovered call look changed."""
    script = textwrap.dedent(
        """
        import json, django
        django.setup()
        from agentops.demo.tools import ALL_TOOLS
        from agentops.bench.agents import TOOLS
        from tests.runs import fingerprinted
        print(json.dumps({t.name: t.version for t in (*ALL_TOOLS, *TOOLS, *fingerprinted.TOOLS)}))
        """
    )
    root = Path(__file__).resolve().parents[2]

    def versions(seed: str) -> dict[str, str]:
        env = {
            **os.environ,
            "PYTHONHASHSEED": seed,
            "PYTHONPATH": str(root),
            "DJANGO_SETTINGS_MODULE": "tests.settings",
        }
        out = subprocess.run(
            [sys.executable, "-c", script],
            cwd=root,
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
            check=True,
        )
        return json.loads(out.stdout.strip().splitlines()[-1])

    from agentops.bench.agents import TOOLS
    from agentops.demo.tools import ALL_TOOLS
    from tests.runs import fingerprinted

    here = {t.name: t.version for t in (*ALL_TOOLS, *TOOLS, *fingerprinted.TOOLS)}
    assert versions("1") == versions("2") == here


# --- a call summarised for people ------------------------------------------------------------


def test_money_is_shown_with_its_currency():
    assert money(250_000, "EUR") == "2,500.00 EUR"
    assert money(5, "USD") == "0.05 USD"
    assert money(-1999, "EUR") == "-19.99 EUR"
    assert money(1500, "JPY", exponent=0) == "1,500 JPY"


def test_a_summary_is_the_tools_own_line_from_masked_arguments():
    # the demo's refund tool declares one; the customer's address arrives masked
    masked = registry.tool("refund_payment").mask(
        {"order_id": "ord_1004", "amount_cents": 250_000, "customer_email": "dave@example.com"}
    )
    assert call_summary("refund_payment", masked) == (
        "Refund 2,500.00 EUR to order ord_1004 (customer ***)"
    )


def test_a_summary_falls_back_to_the_call_and_never_breaks_a_page():
    # unknown tool, or a summary that fails on an old call's arguments
    assert call_summary("gone_tool", {"a": 1}) == "gone_tool(a=1)"
    assert call_summary("refund_payment", {"order_id": "ord_1"}) == (
        "refund_payment(order_id=ord_1)"
    )
    long = call_summary("gone_tool", {"text": "x " * 200})
    assert len(long) == 140 and long.endswith("…") and "\n" not in long


def test_a_summary_is_not_part_of_the_fingerprint():
    def call(arguments, ctx):
        return ToolResult(result={})

    assert _tool(call).version == _tool(call, summary=lambda a: "a charge").version


def test_money_arguments_are_not_part_of_the_fingerprint():
    # how an amount is shown to people (issue 21): declaring it retires no call in flight
    def call(arguments, ctx):
        return ToolResult(result={})

    assert _tool(call).version == _tool(call, money_arguments={"amount": "EUR"}).version


def test_argument_rows_show_money_with_its_currency_and_keep_masked_values():
    rows = argument_rows(
        "refund_payment",
        {"order_id": "ord_1004", "amount_cents": 250000, "customer_email": "***", "n": [1]},
    )
    assert rows == [
        ("order_id", "ord_1004"),
        ("amount_cents", "2,500.00 EUR"),
        ("customer_email", "***"),
        ("n", "[1]"),
    ]
    # an unknown tool: the values as they are
    assert argument_rows("gone_tool", {"amount_cents": 5}) == [("amount_cents", "5")]

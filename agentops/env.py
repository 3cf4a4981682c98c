"""Typed environment helpers that fail loudly.

Settings read the environment through these so a typo such as ``DEBUG=ture`` stops the
process with one clear line instead of silently meaning something else.
"""

from __future__ import annotations

import os
from decimal import Decimal, InvalidOperation

from django.core.exceptions import ImproperlyConfigured

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}


def env_str(name: str, default: str | None = None) -> str:
    value = os.environ.get(name)
    if value is None:
        if default is None:
            raise ImproperlyConfigured(f"environment variable {name} is required")
        return default
    return value


def env_bool(name: str, default: bool) -> bool:
    value = os.environ.get(name)
    if value is None:
        return default
    lowered = value.strip().lower()
    if lowered in _TRUE:
        return True
    if lowered in _FALSE:
        return False
    raise ImproperlyConfigured(
        f"environment variable {name}={value!r} is not a boolean (use 1 or 0)"
    )


def env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    if value is None or value.strip() == "":
        return default
    try:
        return int(value)
    except ValueError:
        raise ImproperlyConfigured(
            f"environment variable {name}={value!r} is not an integer"
        ) from None


def env_float(name: str, default: float) -> float:
    value = os.environ.get(name)
    if value is None or value.strip() == "":
        return default
    try:
        return float(value)
    except ValueError:
        raise ImproperlyConfigured(
            f"environment variable {name}={value!r} is not a number"
        ) from None


def env_list(name: str, default: list[str]) -> list[str]:
    value = os.environ.get(name)
    if value is None:
        return default
    return [item.strip() for item in value.split(",") if item.strip()]


def env_decimal(name: str, default: str) -> Decimal:
    value = os.environ.get(name)
    if value is None or value.strip() == "":
        value = default
    try:
        number = Decimal(value)
    except InvalidOperation:
        raise ImproperlyConfigured(
            f"environment variable {name}={value!r} is not a decimal number"
        ) from None
    if not number.is_finite() or number < 0:
        raise ImproperlyConfigured(f"environment variable {name}={value!r} must be 0 or more")
    return number

"""The domain's errors, under one base: each class says its machine-readable ``code`` and
its HTTP ``status`` once, and the API's error mapping (``runs.api.common``) reads them — a
new error needs no line anywhere else. docs/api.md's table lists every code
(``tests/test_catalogues.py`` checks it).

A service raises them; a page shows the message as a form error, the API answers
``{"code", "detail"}`` with ``status`` (plus ``fields`` for ``validation_error`` and the
machine-readable values in ``extra``, e.g. ``resend_after``); a command prints one line."""

from __future__ import annotations

from typing import Any, ClassVar

# code -> HTTP status, filled as the classes are defined (one status per code)
CODES: dict[str, int] = {}


class DomainError(Exception):
    code: ClassVar[str] = "invalid_state"
    status: ClassVar[int] = 409
    # what a client acts on besides the message (added to the API's error body)
    extra: dict[str, Any] | None = None
    # validation errors by field (``validation_error``)
    fields: dict[str, list[str]] | None = None

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        register(cls.code, cls.status, cls.__qualname__)


def register(code: str, status: int, by: str = "") -> None:
    """One status per code, whoever declares it (a domain error, or the API's own codes)."""
    known = CODES.setdefault(code, status)
    if known != status:
        raise TypeError(f"{by or code}: the code {code!r} is already status {known}, not {status}")


register(DomainError.code, DomainError.status)


class InvalidState(DomainError):
    """The action does not apply in the object's current status."""

    code = "invalid_state"
    status = 409


class InvalidInput(DomainError, ValueError):
    """The input is not valid (a page's form error, the API's ``validation_error``)."""

    code = "validation_error"
    status = 400


class NotFound(DomainError, LookupError):
    code = "not_found"
    status = 404


class PermissionDenied(DomainError):
    """The actor may not do this (checked at the one choke point, ``runs.actors``)."""

    code = "permission_denied"
    status = 403

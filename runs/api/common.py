"""What every API view shares: the error shape, the actor, permissions, pagination.

Every error the API returns is ``{"code": <machine code>, "detail": <human text>}``, plus
``"fields": {name: [messages]}`` for ``validation_error``. Domain errors raised by services
are ``runs.errors.DomainError``s: each class declares its ``code`` and HTTP ``status``, so a
view never translates an error by hand and a new error needs no line here. A domain error
may carry machine-readable values besides (``extra``: e.g. ``resend_after``), added to the
body.
"""

from __future__ import annotations

from typing import Any
from urllib.parse import urlencode

from django.core.exceptions import ObjectDoesNotExist
from django.core.exceptions import PermissionDenied as DjangoPermissionDenied
from django.db import IntegrityError
from django.http import Http404, JsonResponse
from drf_spectacular.utils import OpenApiParameter, OpenApiResponse
from rest_framework import exceptions, pagination, permissions, serializers
from rest_framework.response import Response
from rest_framework.views import set_rollback

from runs.actors import Actor, run_read_scope
from runs.api_parsers import JsonInputRefused
from runs.errors import CODES, DomainError, register
from runs.jsonlimits import JsonRejected
from runs.models import ApiToken
from runs.record.checkpoint import RunNotFound

# The codes of the API itself (DRF's refusals, the JSON rule); every domain error declares
# its own code and status (runs.errors): this is the same table, one status per code.
for _code, _status in (
    ("validation_error", 400),
    ("not_authenticated", 401),
    ("permission_denied", 403),
    ("not_found", 404),
    ("method_not_allowed", 405),
    ("not_acceptable", 406),
    ("unsupported_media_type", 415),
    # runs.jsonlimits: input over the JSON rule's limits, or with a NUL character
    ("json_too_deep", 400),
    ("json_too_large", 400),
    ("nul_byte", 400),
    ("throttled", 429),
):
    register(_code, _status)
STATUS_BY_CODE: dict[str, int] = CODES


class StrictCharField(serializers.CharField):
    """Text that must be sent as a JSON string: DRF's CharField turns a number into its text,
    which the schema (``type: string``) says is refused."""

    def to_internal_value(self, data):
        if not isinstance(data, str):
            self.fail("invalid")
        return super().to_internal_value(data)


class StrictBooleanField(serializers.BooleanField):
    """true or false, as JSON: DRF's BooleanField also takes 0, 1, "yes", "on"..., which the
    schema (``type: boolean``) says are refused."""

    def to_internal_value(self, data):
        if not isinstance(data, bool):
            self.fail("invalid", input=data)
        return data


class ApiError(exceptions.APIException):
    """A domain error raised by an API view itself (not by a service)."""

    def __init__(self, code: str, detail: str, fields: dict[str, list[str]] | None = None):
        self.status_code = STATUS_BY_CODE[code]
        self.code = code
        self.fields = fields
        super().__init__(detail=detail, code=code)


def _flatten(errors: Any) -> dict[str, list[str]]:
    """DRF's nested error detail → ``{"field" or "a.b" or "items.0.x": [messages]}``."""
    flat: dict[str, list[str]] = {}

    def walk(value: Any, path: str) -> None:
        if isinstance(value, dict):
            for key, sub in value.items():
                walk(sub, f"{path}.{key}" if path else str(key))
        elif isinstance(value, list) and value and not all(isinstance(v, str) for v in value):
            for index, sub in enumerate(value):
                walk(sub, f"{path}.{index}" if path else str(index))
        elif isinstance(value, list):
            if value:
                flat.setdefault(path or "non_field_errors", []).extend(str(v) for v in value)
        else:
            flat.setdefault(path or "non_field_errors", []).append(str(value))

    walk(errors, "")
    return flat


def error_body(code: str, detail: str, fields: dict[str, list[str]] | None = None) -> dict:
    body: dict[str, Any] = {"code": code, "detail": detail}
    if code == "validation_error":
        body["fields"] = fields or {}
    return body


def _translate(exc: Exception) -> tuple[str, str, dict[str, list[str]] | None] | None:
    if isinstance(exc, ApiError):
        return exc.code, str(exc.detail), exc.fields
    if isinstance(exc, JsonInputRefused):
        return exc.code, str(exc.detail), None
    if isinstance(exc, exceptions.ValidationError):
        fields = _flatten(exc.detail)
        return "validation_error", "The request is not valid; see fields.", fields
    if isinstance(exc, exceptions.ParseError):
        return "validation_error", str(exc.detail), {"non_field_errors": [str(exc.detail)]}
    if isinstance(exc, exceptions.NotAuthenticated | exceptions.AuthenticationFailed):
        return "not_authenticated", str(exc.detail), None
    if isinstance(exc, exceptions.PermissionDenied | DjangoPermissionDenied):
        return "permission_denied", str(getattr(exc, "detail", "") or exc), None
    if isinstance(exc, exceptions.NotFound | Http404 | RunNotFound | ObjectDoesNotExist):
        return "not_found", "Not found.", None
    if isinstance(exc, exceptions.Throttled):
        return "throttled", str(exc.detail), None
    if isinstance(exc, exceptions.MethodNotAllowed):
        return "method_not_allowed", str(exc.detail), None
    if isinstance(exc, exceptions.NotAcceptable):
        return "not_acceptable", str(exc.detail), None
    if isinstance(exc, exceptions.UnsupportedMediaType):
        return "unsupported_media_type", str(exc.detail), None
    if isinstance(exc, IntegrityError):
        # two requests raced for the same row (the same step of a run, sent twice at once):
        # the loser's transaction is rolled back whole, and it may read again and retry
        return (
            "invalid_state",
            "A concurrent request changed this record first; nothing was written. "
            "Read it again and retry.",
            None,
        )
    if isinstance(exc, DomainError):
        # a service's domain error: its class says its code (and status, STATUS_BY_CODE)
        fields = exc.fields
        if exc.code == "validation_error" and fields is None:
            fields = {"non_field_errors": [str(exc)]}
        return exc.code, str(exc), fields
    if isinstance(exc, JsonRejected):
        return exc.code, exc.detail, None
    return None  # a bug: let it be a 500 and reach the logs


def exception_handler(exc: Exception, context: dict) -> Response | None:
    translated = _translate(exc)
    if translated is None:
        return None
    code, detail, fields = translated
    # as DRF's own handler does: with ATOMIC_REQUESTS, an error response writes nothing
    set_rollback()
    body = error_body(code, detail, fields)
    extra = getattr(exc, "extra", None)
    if isinstance(extra, dict):
        # what the client acts on (when to try again), as fields and not only in prose
        body.update({key: value for key, value in extra.items() if key not in body})
    response = Response(body, status=STATUS_BY_CODE[code])
    if isinstance(exc, exceptions.Throttled) and exc.wait is not None:
        response["Retry-After"] = str(int(exc.wait) + 1)
    if STATUS_BY_CODE[code] == 429 and "retry_after" in body:
        # at_capacity, long_polls_busy: the field, and the header HTTP clients know
        response["Retry-After"] = str(int(body.get("retry_after", 0)) + 1)
    if code == "not_authenticated":
        request = context.get("request")
        view = context.get("view")
        if request is not None and view is not None:
            header = view.get_authenticate_header(request)
            if header:
                response["WWW-Authenticate"] = header
    return response


def json_404(request, exception=None) -> JsonResponse:
    """A URL under /api/ that matches no route (or a malformed id) is JSON too."""
    return JsonResponse(error_body("not_found", "Not found."), status=404)


def json_500(request) -> JsonResponse:
    return JsonResponse(
        {"code": "server_error", "detail": "Internal server error; it has been logged."},
        status=500,
    )


# --- the actor -----------------------------------------------------------------------------


def actor_for(request) -> Actor:
    """Who acts: the API token by name (acting as its principal), or the signed-in user."""
    if isinstance(request.auth, ApiToken):
        return Actor(label=f"token:{request.auth.name}", channel="api", user=request.user)
    return Actor.for_user(request.user, "api")


class HasPerm(permissions.BasePermission):
    """Read access by a Django permission (roles are groups holding permissions)."""

    perm = ""

    def has_permission(self, request, view) -> bool:
        return bool(request.user and request.user.is_authenticated) and request.user.has_perm(
            self.perm
        )


def has_perm(perm: str) -> type[HasPerm]:
    return type(f"Has_{perm.replace('.', '_')}", (HasPerm,), {"perm": perm})


class CanReadRuns(permissions.BasePermission):
    """Some runs to read (``runs.actors.run_read_scope``): all with ``perm``, an agent
    role's own agents' runs; the view filters by the scope (``readable``)."""

    perm = "runs.view_run"

    def has_permission(self, request, view) -> bool:
        return run_read_scope(request.user, perm=self.perm) is not None


class CanReadToolCalls(CanReadRuns):
    perm = "runs.view_toolcall"


def readable(request, queryset, prefix: str = "", perm: str = "runs.view_run"):
    """``queryset`` cut to the runs the request's user may read (``CanReadRuns`` ran)."""
    scope = run_read_scope(request.user, prefix, perm)
    return queryset.filter(scope) if scope is not None else queryset.none()


# --- error responses in the schema ---------------------------------------------------------


class ErrorSerializer(serializers.Serializer):
    code = serializers.CharField(help_text="Machine-readable error code.")
    detail = serializers.CharField(help_text="Human-readable explanation.")
    fields = serializers.DictField(
        child=serializers.ListField(child=serializers.CharField()),
        required=False,
        help_text="Only for validation_error: messages per input field.",
    )
    resend_after = serializers.DateTimeField(
        required=False,
        help_text="lookup_too_early, dispatch_too_early, send_deadline_passed: the call's "
        "landing deadline (server time). Only a lookup begun after it may report absent; a "
        "call without a lookup is dispatched again only after it.",
    )
    send_deadline = serializers.DateTimeField(
        required=False, help_text="send_deadline_passed: the dispatch's send deadline."
    )
    wait_seconds = serializers.FloatField(
        required=False,
        help_text="dispatch_too_early: seconds from now until resend_after, by the server's clock.",
    )
    latest_lookup = serializers.IntegerField(
        required=False, help_text="lookup_superseded: the latest lookup begun (report that one)."
    )
    tool_call = serializers.IntegerField(
        required=False, help_text="client_call_id_conflict: the call the id already names."
    )
    state_version = serializers.IntegerField(
        required=False,
        help_text="state_version_mismatch, patch_test_failed, patch_not_applicable: the run "
        "state's current version (read it again, then patch).",
    )
    last_seq = serializers.IntegerField(
        required=False, help_text="history_conflict: the seq of the history's last message."
    )


def errors(*codes: str, auth: bool = True) -> dict[int, OpenApiResponse]:
    """Schema responses for the given error codes (401/403/429 added for authenticated
    endpoints), grouped by status."""
    all_codes = list(codes)
    if auth:
        all_codes += ["not_authenticated", "permission_denied"]
    all_codes += ["throttled"]
    by_status: dict[int, list[str]] = {}
    for code in all_codes:
        by_status.setdefault(STATUS_BY_CODE[code], []).append(code)
    return {
        status_code: OpenApiResponse(
            ErrorSerializer, description="Error codes: " + ", ".join(f"`{c}`" for c in names)
        )
        for status_code, names in sorted(by_status.items())
    }


# --- query parameters --------------------------------------------------------------------------


class QueryParamsSerializer(serializers.Serializer):
    """Filters from the query string. DRF reads ``?run=`` (an empty value) of a form-style
    input as "not given"; here it is refused for every field that may not be blank (the
    schema's ``minLength: 1``), so a client's empty filter is an error it sees rather than
    silently no filter."""

    def to_internal_value(self, data):
        empty = {
            name: ["may not be empty"]
            for name, field in self.fields.items()
            if not getattr(field, "allow_blank", False)
            and hasattr(data, "getlist")
            and "" in data.getlist(name)
        }
        if empty:
            raise exceptions.ValidationError(empty)
        return super().to_internal_value(data)


# --- pagination ----------------------------------------------------------------------------


class CreatedCursorPagination(pagination.CursorPagination):
    page_size = 50
    page_size_query_param = "limit"
    max_page_size = 200
    ordering = "-created_at"

    def get_page_size(self, request):
        # a limit that is not a number in range is bad input, not silently the default
        raw = request.query_params.get(self.page_size_query_param)
        if raw is None:
            return self.page_size
        try:
            value = int(raw)
        except ValueError:
            value = 0
        if not 1 <= value <= self.max_page_size:
            raise exceptions.ValidationError(
                {self.page_size_query_param: [f"an integer from 1 to {self.max_page_size}"]}
            )
        return value

    def get_schema_operation_parameters(self, view):
        parameters = super().get_schema_operation_parameters(view)
        for parameter in parameters:
            if parameter["name"] == self.page_size_query_param:
                parameter["schema"].update(minimum=1, maximum=self.max_page_size)
        return parameters

    def decode_cursor(self, request):
        # a malformed cursor is bad input, not a missing page
        try:
            return super().decode_cursor(request)
        except exceptions.NotFound:
            raise exceptions.ValidationError({"cursor": [self.invalid_cursor_message]}) from None


class IdCursorPagination(CreatedCursorPagination):
    ordering = "-id"


class SeqPagination(pagination.BasePagination):
    """Events in ``seq`` order after ``after_seq``. The seq is gap-free and never reused, so
    the last seq of a page is itself the cursor: a client that stored it can resume from it
    at any time and will see every later event exactly once."""

    default_limit = 100
    max_limit = 500

    def paginate_queryset(self, queryset, request, view=None):
        self.request = request
        params = SeqPageParams(data=request.query_params)
        params.is_valid(raise_exception=True)
        self.after_seq = params.validated_data.get("after_seq", 0)
        self.limit = params.validated_data.get("limit", self.default_limit)
        rows = list(queryset.filter(seq__gt=self.after_seq).order_by("seq")[: self.limit + 1])
        self.has_more = len(rows) > self.limit
        self.page = rows[: self.limit]
        return self.page

    def _next_url(self) -> str | None:
        if not self.has_more:
            return None
        query = self.request.query_params.copy()
        query["after_seq"] = str(self.page[-1].seq)
        query["limit"] = str(self.limit)
        return self.request.build_absolute_uri(self.request.path) + "?" + urlencode(query)

    def get_paginated_response(self, data) -> Response:
        last = self.page[-1].seq if self.page else self.after_seq
        return Response({"next": self._next_url(), "last_seq": last, "results": data})

    def get_paginated_response_schema(self, schema: dict) -> dict:
        return {
            "type": "object",
            "required": ["next", "last_seq", "results"],
            "properties": {
                "next": {"type": "string", "nullable": True, "format": "uri"},
                "last_seq": {
                    "type": "integer",
                    "description": "Pass as after_seq to continue after this page.",
                },
                "results": schema,
            },
        }

    def get_schema_operation_parameters(self, view) -> list[dict]:
        return [
            {
                "name": "after_seq",
                "in": "query",
                "required": False,
                "description": "Only events with a larger seq (default 0: from the start).",
                "schema": {"type": "integer", "minimum": 0},
            },
            {
                "name": "limit",
                "in": "query",
                "required": False,
                "description": f"Page size (default {self.default_limit}, max {self.max_limit}).",
                "schema": {"type": "integer", "minimum": 1, "maximum": self.max_limit},
            },
        ]


class SeqPageParams(serializers.Serializer):
    after_seq = serializers.IntegerField(min_value=0, required=False)
    limit = serializers.IntegerField(min_value=1, max_value=SeqPagination.max_limit, required=False)


IDEMPOTENCY_KEY_HEADER = OpenApiParameter(
    name="Idempotency-Key",
    location=OpenApiParameter.HEADER,
    required=False,
    type=str,
    description=(
        "Retry-safe creation: the same key with the same body returns the same run (200); "
        "the same key with another body is refused (409 idempotency_key_reused)."
    ),
)

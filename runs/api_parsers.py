"""The API's parser and ``OPTIONS`` metadata (settings: ``REST_FRAMEWORK``). Kept outside
the ``runs.api`` package, whose ``__init__`` imports DRF's views: DRF reads these settings
while defining ``APIView``, so this module must not need ``rest_framework.views`` — nor
anything that imports it (importing ``runs.api.parsers`` would run ``runs.api`` first)."""

from __future__ import annotations

from typing import Any

from django.conf import settings
from rest_framework import exceptions
from rest_framework.metadata import BaseMetadata
from rest_framework.parsers import JSONParser

from runs import jsonlimits


class JsonInputRefused(exceptions.APIException):
    """A body that breaks the JSON rule: 400 with its code (``json_too_deep``,
    ``json_too_large``, ``nul_byte``), mapped by ``runs.api.common``."""

    status_code = 400

    def __init__(self, code: str, detail: str) -> None:
        super().__init__(detail=detail, code=code)
        self.code = code


class LimitedJSONParser(JSONParser):
    """DRF's JSON parser under the one JSON rule (runs.jsonlimits): a body deeper, larger
    or with a NUL character is a 400 with its code, the same on every database."""

    def parse(self, stream, media_type=None, parser_context=None):
        parser_context = parser_context or {}
        encoding = parser_context.get("encoding", settings.DEFAULT_CHARSET)
        _depth, max_bytes, _string = jsonlimits.limits()
        raw = stream.read(max_bytes + 1) if stream is not None else b""
        if len(raw) > max_bytes:
            raise JsonInputRefused("json_too_large", f"the body is over {max_bytes} bytes")
        try:
            return jsonlimits.loads(raw.decode(encoding))
        except jsonlimits.JsonRejected as exc:
            raise JsonInputRefused(exc.code, exc.detail) from None
        except (ValueError, UnicodeDecodeError) as exc:
            raise exceptions.ParseError(f"JSON parse error - {exc}") from None


class PlainMetadata(BaseMetadata):
    """What ``OPTIONS`` answers on every API view: the operation's name and description,
    the media types and the allowed methods (also in the ``Allow`` header). The shapes of
    requests and answers are in the OpenAPI schema (/api/schema/), not guessed from a
    serializer here: DRF's default metadata needs a ``serializer_class`` on the view and
    answered a server error without one."""

    def determine_metadata(self, request, view) -> dict[str, Any]:
        return {
            "name": view.get_view_name(),
            "description": view.get_view_description(),
            "renders": [renderer.media_type for renderer in view.renderer_classes],
            "parses": [parser.media_type for parser in view.parser_classes],
            "methods": sorted(view.allowed_methods),
            "schema": "/api/schema/",
        }

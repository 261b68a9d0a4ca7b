"""HTTP helpers shared by the front ends: JSON responses, error rendering, OpenAPI bodies."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Optional

import orjson
from fastapi import Request
from fastapi.responses import Response
from pydantic import BaseModel

from kubeshard_router.errors import RouterError

if TYPE_CHECKING:
    from kubeshard_router.state import RouterState

log = logging.getLogger("kubeshard.router.http")


class ORJSONResponse(Response):
    media_type = "application/json"

    def render(self, content: Any) -> bytes:
        return orjson.dumps(content)


def get_state(request: Request) -> "RouterState":
    return request.app.state.kubeshard


def api_of(path: str) -> str:
    return "openai" if path.startswith("/v1/") else "tgi"


def route_of(path: str) -> str:
    for suffix in ("/generate_stream", "/generate", "/info", "/health"):
        if path.endswith(suffix):
            return suffix
    if path.startswith("/v1/"):
        return path
    return "/" if path == "/" or path.startswith("/models/") else path


def error_response(exc: RouterError, api: str, state: Optional["RouterState"] = None,
                   model: Optional[str] = None, route: Optional[str] = None) -> Response:
    if state is not None:
        state.count(model or "-", route or "-", exc.status)
    return Response(exc.body(api), status_code=exc.status, headers=exc.headers,
                    media_type="application/json")


def json_body_doc(model: type[BaseModel]) -> dict:
    """``openapi_extra`` documenting a JSON body the handler parses itself (with orjson)."""
    return {"requestBody": {"required": True, "content": {"application/json": {
        "schema": {"$ref": f"#/components/schemas/{model.__name__}"}}}}}

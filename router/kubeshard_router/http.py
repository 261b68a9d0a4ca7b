"""HTTP helpers shared by the front ends: JSON responses, error rendering, OpenAPI bodies."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional

import orjson
from fastapi import Request
from fastapi.responses import Response
from pydantic import BaseModel

from kubeshard_router.errors import RouterError
from kubeshard_router.metrics import RouterMetrics

if TYPE_CHECKING:
    from kubeshard_router.intake import Intake
    from kubeshard_router.state import RouterState


class ORJSONResponse(Response):
    media_type = "application/json"

    def render(self, content: Any) -> bytes:
        return orjson.dumps(content)


def get_state(request: Request) -> "RouterState":
    return request.app.state.kubeshard


def get_intake(request: Request) -> "Intake":
    return get_state(request).intake


def api_of(path: str) -> str:
    return "openai" if path.startswith("/v1/") else "tgi"


def route_of(path: str) -> str:
    for suffix in ("/generate_stream", "/generate", "/info", "/health"):
        if path.endswith(suffix):
            return suffix
    if path.startswith("/v1/"):
        return path
    return "/" if path == "/" or path.startswith("/models/") else path


def error_response(exc: RouterError, api: str, metrics: Optional[RouterMetrics] = None,
                   model: Optional[str] = None, route: Optional[str] = None) -> Response:
    """The error as the API's JSON; counted in ``metrics`` when given."""
    if metrics is not None:
        metrics.count_request(model or "-", route or "-", exc.status)
    return Response(exc.body(api), status_code=exc.status, headers=exc.headers,
                    media_type="application/json")


# the models of the bodies json_body_doc documents, by name: the app's OpenAPI document
# holds their schemas (a route's $ref to one it lacked pointed nowhere)
DOCUMENTED_BODIES: dict[str, type[BaseModel]] = {}


def json_body_doc(*models: type[BaseModel]) -> dict:
    """``openapi_extra`` documenting a JSON body the handler parses itself (with orjson):
    one of ``models`` (a route that takes several APIs' bodies names each)."""
    refs = []
    for model in models:
        DOCUMENTED_BODIES[model.__name__] = model
        refs.append({"$ref": f"#/components/schemas/{model.__name__}"})
    return {"requestBody": {"required": True, "content": {"application/json": {
        "schema": refs[0] if len(refs) == 1 else {"anyOf": refs}}}}}

"""``GET /internal/load``: this router instance's per-model load, for the operator's
metrics server when Redis is away (it asks every router pod directly, so autoscaling
never depends on Redis alone).

The same fields as the Redis load hash (counters.py). The endpoint shares the public
port, so it is authenticated: ``Authorization: Bearer <token>`` with the token of
``--load-token-file`` (the chart's generated Secret, mounted into the routers and the
metrics server). Without a token file the route answers 404.
"""

from __future__ import annotations

import hmac
import time

from fastapi import APIRouter, Request
from fastapi.responses import Response

from kubeshard_router.http import ORJSONResponse, get_state

router = APIRouter(include_in_schema=False)


@router.get("/internal/load")
async def internal_load(request: Request) -> Response:
    state = get_state(request)
    token = state.load_token
    if token is None:
        return ORJSONResponse({"error": "not found", "error_type": "not_found"}, status_code=404)
    given = request.headers.get("authorization", "")
    if not hmac.compare_digest(given.encode(), f"Bearer {token}".encode()):
        return ORJSONResponse({"error": "a valid load token is required", "error_type": "unauthorized"},
                              status_code=401, headers={"WWW-Authenticate": "Bearer"})
    models = [{"model": load.model, "revision": load.revision, **load.fields()}
              for load in state.load_snapshot()]
    return ORJSONResponse({"router_id": state.config.router_id, "time": time.time(), "models": models})

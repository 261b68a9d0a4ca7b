"""The FastAPI app factory: builds the router's parts (``RouterState``), mounts the TGI and
OpenAI routes and the playground page, and maps every error to JSON."""

from __future__ import annotations

import logging
from contextlib import asynccontextmanager
from typing import AsyncIterator, Optional

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from kubeshard_router import __version__
from kubeshard_router.activation import ScaleUpHook
from kubeshard_router.backends.source import BackendSource
from kubeshard_router.config import RouterConfig
from kubeshard_router.errors import RouterError, ValidationFailed
from kubeshard_router.http import DOCUMENTED_BODIES, ORJSONResponse, api_of, error_response, get_state, route_of
from kubeshard_router.load_api import router as load_router
from kubeshard_router.openai_api import router as openai_router
from kubeshard_router.playground import router as playground_router
from kubeshard_router.state import RouterState
from kubeshard_router.tgi_api import router as tgi_router
from kubeshard_router.tokenize_api import router as tokenize_router

log = logging.getLogger("kubeshard.router")

def default_sources(config: RouterConfig) -> list[BackendSource]:
    sources: list[BackendSource] = []
    if config.backends:
        from kubeshard_router.backends.static import StaticSource
        sources.append(StaticSource(config.backends))
    if config.kubernetes:
        from kubeshard_router.backends.kubernetes import KubernetesSource
        sources.append(KubernetesSource(namespace=config.namespace))
    return sources


def create_app(config: RouterConfig, *, sources: Optional[list[BackendSource]] = None,
               hook: Optional[ScaleUpHook] = None, balance_mode: str = "prefix") -> FastAPI:
    state = RouterState(config, sources if sources is not None else default_sources(config),
                        hook=hook, balance_mode=balance_mode)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await state.start()
        try:
            yield
        finally:
            state.start_draining()
            await state.stop()

    app = FastAPI(title="kubeshard router", version=__version__, lifespan=lifespan,
                  description="TGI- and OpenAI-compatible HTTP/SSE front for kubeshard model replicas.")
    app.state.kubeshard = state
    app.include_router(tgi_router)
    app.include_router(openai_router)
    app.include_router(playground_router)
    app.include_router(load_router)
    app.include_router(tokenize_router)

    @app.get("/livez", tags=["Observability"], summary="200 while the router process runs")
    async def livez() -> Response:
        return Response(status_code=200)

    @app.get("/readyz", tags=["Observability"], summary="200 while the router accepts requests")
    async def readyz(request: Request) -> Response:
        if get_state(request).draining:
            return ORJSONResponse({"error": "router is shutting down", "error_type": "unhealthy"},
                                  status_code=503)
        return Response(status_code=200)

    @app.exception_handler(RouterError)
    async def on_router_error(request: Request, exc: RouterError) -> Response:
        return error_response(exc, api_of(request.url.path), state.metrics, exc.model,
                              route_of(request.url.path))

    @app.exception_handler(RequestValidationError)
    async def on_validation(request: Request, exc: RequestValidationError) -> Response:
        parts = []
        for err in exc.errors()[:3]:
            loc = ".".join(str(x) for x in err.get("loc", ()) if x not in ("body", "path", "query"))
            parts.append(f"`{loc or 'request'}`: {err.get('msg', 'invalid')}")
        return error_response(ValidationFailed("; ".join(parts)), api_of(request.url.path), state.metrics)

    @app.exception_handler(StarletteHTTPException)
    async def on_http(request: Request, exc: StarletteHTTPException) -> Response:
        err = RouterError(str(exc.detail))
        err.status = exc.status_code
        err.error_type = "not_found" if exc.status_code == 404 else "http"
        err.openai_type = "invalid_request_error"
        return Response(err.body(api_of(request.url.path)), status_code=exc.status_code,
                        headers=dict(exc.headers or {}), media_type="application/json")

    @app.exception_handler(Exception)
    async def on_unexpected(request: Request, exc: Exception) -> Response:
        log.exception("unexpected error on %s %s", request.method, request.url.path)
        err = RouterError(f"internal router error ({type(exc).__name__}); see the router log")
        return error_response(err, api_of(request.url.path), state.metrics)

    cached: dict = {}

    def openapi() -> dict:
        # Rebuilt when the set of models changes: the `model` path parameter lists them.
        models = sorted(state.registry.models)
        if cached.get("models") == models:
            return cached["schema"]
        schema = get_openapi(title=app.title, version=app.version, description=app.description,
                             routes=app.routes)
        components = schema.setdefault("components", {}).setdefault("schemas", {})
        for model in DOCUMENTED_BODIES.values():
            js = model.model_json_schema(ref_template="#/components/schemas/{model}")
            components.update(js.pop("$defs", {}))
            components[model.__name__] = js
        for item in schema.get("paths", {}).values():
            for operation in item.values():
                for param in operation.get("parameters", []):
                    if param.get("name") == "model" and param.get("in") == "path" and models:
                        param["schema"] = {**param.get("schema", {}), "enum": models}
        cached.update(models=models, schema=schema)
        app.openapi_schema = schema
        return schema

    app.openapi = openapi  # type: ignore[method-assign]
    return app



"""Errors a request can end with, and how each API renders them.

TGI routes answer ``{"error": "...", "error_type": "..."}``; OpenAI routes answer
``{"error": {"message", "type", "param", "code"}}`` (plus ``error_type`` so a TGI
client calling /v1/chat/completions still classifies it).
"""

from __future__ import annotations

from typing import Optional

import orjson


class RouterError(Exception):
    status = 500
    error_type = "internal"
    openai_type = "server_error"
    model: Optional[str] = None  # the model the failed request was for, once known

    def __init__(self, message: str, *, param: Optional[str] = None,
                 headers: Optional[dict[str, str]] = None, code: Optional[str] = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.headers = headers or {}
        self.code = code

    def for_model(self, model: str) -> "RouterError":
        """Names the model the failed request was for (it labels the error's request count)."""
        self.model = model
        return self

    def tgi_body(self) -> dict:
        return {"error": self.message, "error_type": self.error_type}

    def openai_body(self) -> dict:
        return {
            "error": {"message": self.message, "type": self.openai_type,
                      "param": self.param, "code": self.code or self.error_type},
            "error_type": self.error_type,
        }

    def body(self, api: str) -> bytes:
        return orjson.dumps(self.openai_body() if api == "openai" else self.tgi_body())


class MalformedRequest(RouterError):
    """The body is not JSON (or not an object)."""
    status = 400
    error_type = "validation"
    openai_type = "invalid_request_error"


class ValidationFailed(RouterError):
    """The request is well-formed JSON but a field is wrong."""
    status = 422
    error_type = "validation"
    openai_type = "invalid_request_error"

    def __init__(self, message: str, **kwargs) -> None:
        super().__init__(f"Input validation error: {message}", **kwargs)


class PayloadTooLarge(RouterError):
    status = 413
    error_type = "validation"
    openai_type = "invalid_request_error"


class Unauthorized(RouterError):
    status = 401
    error_type = "authentication"
    openai_type = "authentication_error"

    def __init__(self, message: str) -> None:
        super().__init__(message, headers={"WWW-Authenticate": 'Bearer realm="kubeshard"'},
                         code="invalid_api_key")


class Forbidden(RouterError):
    """The caller is known (or no keys are set) but may not do this: an admin route that is
    off, or a key without the admin role."""
    status = 403
    error_type = "forbidden"
    openai_type = "permission_error"

    def __init__(self, message: str, *, code: str = "forbidden") -> None:
        super().__init__(message, code=code)


class ModelNotFound(RouterError):
    status = 404
    error_type = "not_found"
    openai_type = "invalid_request_error"

    def __init__(self, model: str, known: list[str]) -> None:
        listed = ", ".join(f"`{m}`" for m in sorted(known)) or "none"
        super().__init__(f"model `{model}` does not exist; served models: {listed}",
                         param="model", code="model_not_found")


class Overloaded(RouterError):
    """The per-model queue is full (or the engine refused for capacity)."""
    status = 429
    error_type = "overloaded"
    openai_type = "rate_limit_error"

    def __init__(self, message: str, retry_after_s: int = 1) -> None:
        super().__init__(message, headers={"Retry-After": str(max(1, int(retry_after_s)))},
                         code="overloaded")


class RateLimited(RouterError):
    status = 429
    error_type = "rate_limit"
    openai_type = "rate_limit_error"

    def __init__(self, message: str, retry_after_s: float) -> None:
        super().__init__(message, headers={"Retry-After": str(max(1, int(retry_after_s + 0.999)))},
                         code="rate_limit_exceeded")


class BackendFailed(RouterError):
    """The backend failed the generation, or no replica could start it (TGI: 424)."""
    status = 424
    error_type = "generation"
    openai_type = "server_error"


class IncompleteGeneration(RouterError):
    """The stream ended after some tokens without a finish (only ever sent as an SSE event)."""
    status = 424
    error_type = "incomplete_generation"
    openai_type = "server_error"


class NoBackend(RouterError):
    """The model has no ready replica (and none came up within the activation timeout)."""
    status = 503
    error_type = "unavailable"
    openai_type = "server_error"

    def __init__(self, message: str) -> None:
        super().__init__(message, headers={"Retry-After": "5"}, code="no_backend")

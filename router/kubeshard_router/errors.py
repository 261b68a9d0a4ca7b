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
    default_code: Optional[str] = None  # OpenAI's `code` when the raiser names none
    model: Optional[str] = None  # the model the failed request was for, once known

    def __init__(self, message: str, *, param: Optional[str] = None,
                 headers: Optional[dict[str, str]] = None, code: Optional[str] = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.headers = headers or {}
        self.code = code or self.default_code

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


def retry_after(seconds: int) -> dict[str, str]:
    """The Retry-After header: whole seconds, at least one."""
    return {"Retry-After": str(max(1, seconds))}


class InvalidRequest(RouterError):
    """The client must change the request (OpenAI's ``invalid_request_error``)."""
    error_type = "validation"
    openai_type = "invalid_request_error"


class MalformedRequest(InvalidRequest):
    """The body is not JSON (or not an object)."""
    status = 400


class ValidationFailed(InvalidRequest):
    """The request is well-formed JSON but a field is wrong."""
    status = 422

    def __init__(self, message: str, **kwargs) -> None:
        super().__init__(f"Input validation error: {message}", **kwargs)


class PayloadTooLarge(InvalidRequest):
    status = 413


class Unauthorized(RouterError):
    status = 401
    error_type = "authentication"
    openai_type = "authentication_error"
    default_code = "invalid_api_key"

    def __init__(self, message: str) -> None:
        super().__init__(message, headers={"WWW-Authenticate": 'Bearer realm="kubeshard"'})


class Forbidden(RouterError):
    """The caller is known (or no keys are set) but may not do this: an admin route that is
    off, or a key without the admin role."""
    status = 403
    error_type = "forbidden"
    openai_type = "permission_error"
    default_code = "forbidden"


class ModelNotFound(InvalidRequest):
    status = 404
    error_type = "not_found"
    default_code = "model_not_found"

    def __init__(self, model: str, known: list[str]) -> None:
        listed = ", ".join(f"`{m}`" for m in sorted(known)) or "none"
        super().__init__(f"model `{model}` does not exist; served models: {listed}", param="model")


class TooManyRequests(RouterError):
    """429: try again after the Retry-After header's seconds."""
    status = 429
    openai_type = "rate_limit_error"

    def __init__(self, message: str, retry_after_s: int) -> None:
        super().__init__(message, headers=retry_after(retry_after_s))


class Overloaded(TooManyRequests):
    """The per-model queue is full (or the engine refused for capacity)."""
    error_type = "overloaded"
    default_code = "overloaded"

    def __init__(self, message: str, retry_after_s: int = 1) -> None:
        super().__init__(message, int(retry_after_s))


class RateLimited(TooManyRequests):
    """The API key spent its requests or tokens per minute."""
    error_type = "rate_limit"
    default_code = "rate_limit_exceeded"

    def __init__(self, message: str, retry_after_s: float) -> None:
        super().__init__(message, int(retry_after_s + 0.999))


class BackendFailed(RouterError):
    """The backend failed the generation, or no replica could start it (TGI: 424)."""
    status = 424
    error_type = "generation"


class IncompleteGeneration(BackendFailed):
    """The stream ended after some tokens without a finish (only ever sent as an SSE event)."""
    error_type = "incomplete_generation"


class NoBackend(RouterError):
    """The model has no ready replica (and none came up within the activation timeout)."""
    status = 503
    error_type = "unavailable"
    default_code = "no_backend"

    def __init__(self, message: str) -> None:
        super().__init__(message, headers=retry_after(5))

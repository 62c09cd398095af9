"""Errors in OpenAI's shape: {"error": {"message", "type", "param", "code"}}, whatever failed.

A client's mistake is a 4xx naming the problem, never a 500: FastAPI's own 422 for a body
that does not validate becomes a 400 (OpenAI's status for bad parameters) whose `param` is
the field's path; unknown routes and methods keep their 404 / 405 in the same shape; an
overloaded engine answers 429 with Retry-After. Anything unexpected is a 500 in the same
shape (and is a bug to fix).
"""
from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..async_engine import EngineOverloaded
from ..engine_state import (
    EngineStepError,
    EngineUnavailable,
    RequestTimeoutError,
    SamplingError,
)

log = logging.getLogger("layer6_serving")

TYPES = {400: "invalid_request_error", 401: "invalid_request_error", 404: "invalid_request_error",
         405: "invalid_request_error", 408: "timeout_error", 413: "invalid_request_error",
         429: "rate_limit_exceeded", 500: "server_error", 503: "server_error"}


class OpenAIError(Exception):
    """Raise from a route to answer `status` with OpenAI's error body."""

    def __init__(self, status: int, message: str, *, param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers

    def body(self) -> dict:
        kind = TYPES.get(self.status, "invalid_request_error")
        return {"error": {"message": self.message, "type": kind, "param": self.param,
                          "code": self.code}}

    def response(self, *, close: bool = False) -> JSONResponse:
        headers = dict(self.headers or {})
        if close:  # the body was not read: the connection cannot carry another request
            headers["Connection"] = "close"
        return JSONResponse(self.body(), status_code=self.status, headers=headers or None)


def from_exception(e: BaseException) -> OpenAIError:
    """The OpenAIError for an exception the engine or a route raised."""
    if isinstance(e, OpenAIError):
        return e
    if isinstance(e, ValueError):
        return OpenAIError(400, str(e), code="invalid_value")
    if isinstance(e, EngineOverloaded):
        return OpenAIError(429, str(e), code="rate_limit_exceeded",
                           headers={"Retry-After": str(e.retry_after)})
    if isinstance(e, RequestTimeoutError):
        return OpenAIError(408, str(e), code="timeout")
    if isinstance(e, EngineUnavailable):
        return OpenAIError(503, str(e), code="engine_unavailable", headers={"Retry-After": "5"})
    if isinstance(e, SamplingError):
        return OpenAIError(500, str(e), code="sampling_error")
    if isinstance(e, EngineStepError):
        return OpenAIError(500, str(e), code="engine_error")
    log.exception("unexpected error", exc_info=e)
    return OpenAIError(500, f"internal error: {type(e).__name__}: {e}", code="internal_error")


def _field_path(loc) -> str:
    """('body', 'prompt', 'list[str]', 1) -> "prompt.1": the field, not pydantic's union arm."""
    return ".".join(str(p) for p in loc if p != "body" and not (isinstance(p, str) and "[" in p))


def _validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
    errors = list(exc.errors())
    # a union's arms each report: the arm that matched the type says what is wrong
    def rank(e) -> tuple[bool, int]:  # a value's own problem first, then the deepest path
        msg = str(e.get("msg", ""))
        generic = msg.startswith("Input should be a valid") and "unicode" not in msg
        return generic, -len(_field_path(e.get("loc", ())).split("."))
    errors.sort(key=rank)
    lines = dict.fromkeys(f"{_field_path(e.get('loc', ())) or 'body'}: {e.get('msg', 'invalid')}"
                          for e in errors)
    first = errors[0] if errors else {}
    return OpenAIError(400, "; ".join(list(lines)[:3]) or "invalid request",
                       param=_field_path(first.get("loc", ())) or None,
                       code="invalid_request").response()


def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
    code = {404: "not_found", 405: "method_not_allowed",
            413: "body_too_large"}.get(exc.status_code)
    err = OpenAIError(exc.status_code, str(exc.detail), code=code,
                      headers=getattr(exc, "headers", None))
    return err.response()


class ErrorBody(BaseModel):
    """OpenAI's error object: {"error": {"message", "type", "param", "code"}}."""

    class Detail(BaseModel):
        message: str
        type: str
        param: str | None = None
        code: str | None = None

    error: Detail


ERROR_RESPONSES: dict[int | str, dict] = {
    400: {"model": ErrorBody, "description": "Bad request: a field is invalid (param names it)"},
    401: {"model": ErrorBody, "description": "Missing or wrong API key"},
    404: {"model": ErrorBody, "description": "No such model (or route)"},
    408: {"model": ErrorBody, "description": "The request ran past its timeout"},
    413: {"model": ErrorBody, "description": "The body is over the server's size limit"},
    429: {"model": ErrorBody, "description": "Too many requests waiting: retry after "
                                             "Retry-After seconds"},
    503: {"model": ErrorBody, "description": "The engine is down or restarting: retry"},
}


def openapi_schema(app: FastAPI) -> dict:
    """FastAPI's schema, minus the 422 it adds to every route with a body: this server
    answers a body that does not validate with a 400 in OpenAI's shape (documented above)."""
    if app.openapi_schema is None:
        from fastapi.openapi.utils import get_openapi

        schema = get_openapi(title=app.title, version=app.version,
                             description=app.description, routes=app.routes)
        for path in schema.get("paths", {}).values():
            for op in path.values():
                op.get("responses", {}).pop("422", None)
        for name in ("HTTPValidationError", "ValidationError"):
            schema.get("components", {}).get("schemas", {}).pop(name, None)
        app.openapi_schema = schema
    return app.openapi_schema


def install(app: FastAPI) -> None:
    """Every error the app can produce answers in OpenAI's shape."""
    app.add_exception_handler(OpenAIError, lambda _, e: e.response())
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(Exception, lambda _, e: from_exception(e).response())

"""OpenAI-style errors: every failure, ours or the client's, leaves as `{"error": {...}}` with a fitting status."""

from __future__ import annotations

import json
import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from mlaserve.error_text import error_text

logger = logging.getLogger(__name__)

# The `type` OpenAI clients switch on, by HTTP status.
_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    408: "timeout_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    429: "rate_limit_error",
    503: "service_unavailable",
}


class SafeJSONResponse(JSONResponse):
    """JSON with non-ASCII escaped: an error message may quote what the client sent, and a lone surrogate in it
    (which UTF-8 cannot encode) must not turn a 4xx into a 500."""

    def render(self, content: Any) -> bytes:
        return json.dumps(content, ensure_ascii=True, separators=(",", ":")).encode("ascii")


class OpenAIError(Exception):
    """An error to send to the client. `status` is the metrics label it counts under (see metrics.py);
    None when the request was already counted."""

    def __init__(
        self,
        status_code: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
        status: str | None = "rejected",
    ) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers
        self.status = status

    def body(self) -> dict:
        return error_body(self.status_code, self.message, self.param, self.code)

    def response(self) -> JSONResponse:
        return SafeJSONResponse(self.body(), status_code=self.status_code, headers=self.headers)


def error_body(status_code: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    kind = _TYPES.get(status_code, "invalid_request_error" if status_code < 500 else "server_error")
    if status_code >= 500:  # the server's own failure: its text may hold a backtrace or this machine's paths
        message = error_text(message)
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> OpenAIError:
    return OpenAIError(400, message, param, code)


def _count(request: Request, status: str | None) -> None:
    if status is None:
        return
    count = getattr(request.app.state, "count_request", None)  # absent on the ops app
    if count is not None:
        count(request.url.path, status)


def install_error_handlers(app: FastAPI) -> None:
    """Replace FastAPI's `{"detail": ...}` bodies so that no path answers in a non-OpenAI shape."""

    async def on_openai_error(request: Request, exc: OpenAIError) -> JSONResponse:
        _count(request, exc.status)
        return exc.response()

    async def on_http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        body = error_body(exc.status_code, str(exc.detail))
        return SafeJSONResponse(body, status_code=exc.status_code, headers=getattr(exc, "headers", None))

    async def on_validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        errors = exc.errors()
        first = errors[0] if errors else {}
        param = ".".join(str(p) for p in first.get("loc", ()) if p != "body") or None
        return SafeJSONResponse(
            error_body(400, f"{param}: {first.get('msg', 'invalid request')}", param), 400
        )

    async def on_unexpected(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error on %s %s", request.method, request.url.path)
        _count(request, "error")
        return SafeJSONResponse(error_body(500, f"internal server error: {type(exc).__name__}"), 500)

    app.add_exception_handler(OpenAIError, on_openai_error)
    app.add_exception_handler(StarletteHTTPException, on_http_error)
    app.add_exception_handler(RequestValidationError, on_validation_error)
    app.add_exception_handler(Exception, on_unexpected)

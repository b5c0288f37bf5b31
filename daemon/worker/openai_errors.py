"""OpenAI-style error objects for every error the serving API returns.

    {"error": {"message": "...", "type": "invalid_request_error", "param": "seed", "code": "invalid_value"}}

The official clients read `message` (shown to the user), `type`, `param` and `code`; a bare
string under "error" makes them print only the status line. Every serving route, an unknown
path, a wrong method, an oversized body and an unexpected exception answer with this shape.
(The admin routes keep their own `{"error": "..."}` documents: the daemon reads those.)
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from starlette.responses import Response

log = logging.getLogger("hotswap.worker.api")

ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "invalid_request_error",
    409: "conflict_error",
    413: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    503: "service_unavailable_error",
}


class ApiError(Exception):
    """Raised anywhere under a serving route; becomes one error object with this status."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
        extra: dict[str, Any] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers
        self.extra = extra or {}

    def body(self) -> dict[str, Any]:
        return error_body(self.status, self.message, param=self.param, code=self.code) | self.extra

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def error_body(status: int, message: str, *, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    kind = ERROR_TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def bad_request(message: str, param: str | None = None, code: str = "invalid_value") -> ApiError:
    return ApiError(400, message, param=param, code=code)


def install_error_handlers(app: FastAPI) -> None:
    """Unknown paths, wrong methods, validation and unexpected exceptions as error objects."""

    async def api_error(_request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, ApiError)
        return exc.response()

    async def http_error(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, StarletteHTTPException)
        status = exc.status_code
        message = {404: f"no route {request.url.path}", 405: f"{request.method} is not allowed on {request.url.path}"}
        return ApiError(status, message.get(status, str(exc.detail)), code="not_found" if status == 404 else None,
                        headers=getattr(exc, "headers", None)).response()

    async def validation_error(_request: Request, exc: Exception) -> JSONResponse:
        return ApiError(400, f"invalid request: {exc}", code="invalid_value").response()

    async def disconnected(_request: Request, _exc: Exception) -> Response:
        return Response(status_code=499)  # the client left while sending its body: nobody to answer

    async def unexpected(request: Request, exc: Exception) -> JSONResponse:
        # A bug, not the client's fault: log it whole, answer one line without internals.
        log.error("unhandled error on %s %s", request.method, request.url.path, exc_info=exc)
        return ApiError(500, f"internal error ({type(exc).__name__}); see the worker log",
                        code="internal_error").response()

    app.add_exception_handler(ApiError, api_error)
    app.add_exception_handler(StarletteHTTPException, http_error)
    app.add_exception_handler(RequestValidationError, validation_error)
    app.add_exception_handler(ClientDisconnect, disconnected)
    app.add_exception_handler(Exception, unexpected)

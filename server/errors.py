"""Errors in the OpenAI shape `{"error": {"message", "type", "param", "code"}}`, `code` being the HTTP status.

Handlers are installed for our own APIError, for FastAPI's request validation (400, never its default 422), for
Starlette's HTTP errors (unknown route, wrong method) and for anything unexpected (500).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

log = logging.getLogger("jaxserve.server")

ERROR_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    404: "NotFoundError",
    405: "BadRequestError",
    413: "RequestTooLargeError",
    429: "RateLimitError",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
}
RETRY_AFTER_SECONDS = 1  # for 429 / 503: the openai client retries politely after this


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, headers: Mapping[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.headers = dict(headers or {})
        if status in (429, 503):
            self.headers.setdefault("Retry-After", str(RETRY_AFTER_SECONDS))

    def body(self) -> dict:
        return error_body(self.status, self.message, self.param)

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def error_body(status: int, message: str, param: str | None = None) -> dict:
    return {"error": {"message": message, "type": ERROR_TYPES.get(status, "APIError"), "param": param, "code": status}}


def bad_request(param: str | None, message: str) -> APIError:
    return APIError(400, message, param)


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(_: Request, error: APIError) -> JSONResponse:
        return error.response()

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, error: RequestValidationError) -> JSONResponse:
        first = error.errors()[0] if error.errors() else {}
        param = ".".join(str(p) for p in first.get("loc", ())[1:]) or None
        return bad_request(param, f"{param or 'request'}: {first.get('msg', 'invalid request')}").response()

    @app.exception_handler(HTTPException)
    async def _http(_: Request, error: HTTPException) -> JSONResponse:
        return APIError(error.status_code, str(error.detail), headers=error.headers).response()

    @app.exception_handler(Exception)
    async def _internal(_: Request, error: Exception) -> JSONResponse:
        log.exception("unhandled error")
        return APIError(500, f"internal server error: {type(error).__name__}: {error}").response()

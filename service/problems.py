"""Errors as RFC 9457 problem details (application/problem+json) whose `detail` says what was wrong."""
from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException

PROBLEM_JSON = "application/problem+json"
log = logging.getLogger("kiln.service")


class Problem(BaseModel):
    """The body of every error response."""

    type: str = "about:blank"
    title: str
    status: int
    detail: str
    instance: str | None = None


class APIError(Exception):
    def __init__(self, status: int, title: str, detail: str, *, headers: dict[str, str] | None = None,
                 kind: str = "about:blank"):
        super().__init__(detail)
        self.status, self.title, self.detail = status, title, detail
        self.headers = headers or {}
        self.kind = kind


def problem_response(status: int, title: str, detail: str, instance: str | None = None,
                     headers: dict[str, str] | None = None, kind: str = "about:blank") -> JSONResponse:
    body = Problem(type=kind, title=title, status=status, detail=detail, instance=instance)
    return JSONResponse(body.model_dump(exclude_none=True), status_code=status,
                        media_type=PROBLEM_JSON, headers=headers)


def _validation_detail(exc: RequestValidationError) -> str:
    parts = []
    for err in exc.errors():
        loc = ".".join(str(x) for x in err.get("loc", ()) if x not in ("body",))
        msg = str(err.get("msg", "invalid")).removeprefix("Value error, ")
        parts.append(f"{loc}: {msg}" if loc else msg)
    return "; ".join(parts) or "invalid request"


def install(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        return problem_response(exc.status, exc.title, exc.detail, request.url.path,
                                exc.headers, exc.kind)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError):
        return problem_response(422, "Unprocessable Content", _validation_detail(exc),
                                request.url.path)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException):
        detail = exc.detail if isinstance(exc.detail, str) else str(exc.detail)
        title = {404: "Not Found", 405: "Method Not Allowed"}.get(exc.status_code, "Error")
        return problem_response(exc.status_code, title, detail, request.url.path,
                                getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception):
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        return problem_response(500, "Internal Server Error",
                                f"internal error ({type(exc).__name__}); see the service log",
                                request.url.path)


PROBLEM_RESPONSES: dict[int | str, dict[str, Any]] = {
    code: {"model": Problem, "content": {PROBLEM_JSON: {}}, "description": text}
    for code, text in ((401, "missing or invalid API key"), (404, "not found (or another tenant's)"),
                       (422, "the request is invalid; `detail` says how"))
}

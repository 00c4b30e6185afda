"""What every API request meets before (and after) a route: the one error shape and the guard.

``RequestGuard`` checks the bearer token, the body size (from Content-Length and while the body
streams in), the JSON nesting depth and parseability, all before FastAPI parses anything; the
error handlers turn every refusal, FastAPI's validation errors included, into an ``ErrorBody``.
"""

from __future__ import annotations

import hmac
import json
import logging
import re
from collections.abc import Sequence

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from robustrl.errors import JobError, TransportError
from robustrl.jsonlimits import json_too_deep

log = logging.getLogger(__name__)
MAX_BODY_BYTES = 1 << 20
MAX_JSON_DEPTH = 32
"""A job spec nests 3 levels; anything deeper than this is refused before it is parsed."""
PUBLIC_PATHS = frozenset({"/healthz", "/dashboard", "/openapi.json", "/docs", "/docs/oauth2-redirect", "/redoc"})


# --- the one error shape -------------------------------------------------------------------------

class FieldError(BaseModel):
    field: str = Field(description="Dotted path of the bad field, e.g. detector.silence_s; <body> for the body.")
    error: str


class ErrorDetail(BaseModel):
    code: str = Field(description="Stable machine-readable code, e.g. validation_error, body_too_large.")
    message: str
    fields: list[FieldError] = Field(default_factory=list)


class ErrorBody(BaseModel):
    """Every 4xx/5xx answer of the API."""

    error: ErrorDetail


CODES = {400: "bad_request", 401: "unauthorized", 404: "not_found", 405: "method_not_allowed", 409: "conflict",
         413: "body_too_large", 415: "unsupported_media_type", 422: "validation_error", 503: "unavailable"}
DESCRIPTIONS = {400: "Body is not JSON, or nests too deep", 401: "Missing or wrong bearer token",
                404: "No such job", 405: "Method not allowed on this path",
                409: "The job's state forbids it, or this controller is a standby",
                413: f"Body larger than {MAX_BODY_BYTES} bytes", 415: "A body that is not JSON",
                422: "A field is invalid; each bad field is named",
                503: "Members could not be launched, or NATS / Redis did not answer in time"}


def error_response(status: int, message: str, fields: Sequence[FieldError] = (), *, code: str | None = None,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    body = ErrorBody(error=ErrorDetail(code=code or CODES.get(status, f"http_{status}"), message=message,
                                       fields=list(fields)))
    return JSONResponse(body.model_dump(), status_code=status, headers=headers)


# --- the guard in front of every route -----------------------------------------------------------

class RequestGuard:
    """ASGI middleware: token first (an anonymous client cannot make the server buffer anything),
    then the body limit from Content-Length and again while the body streams in (a 64 MiB body is
    refused after ``max_bytes``, not read whole), then JSON nesting depth and parseability on the
    buffered bytes. The route sees the buffered body replayed.

    Not Starlette's ``RequestBodyLimitMiddleware``: it answers in plain text, only exists in the
    newest releases, and cannot share the buffered body with the depth check."""

    def __init__(self, app: ASGIApp, *, token: str, max_bytes: int = MAX_BODY_BYTES,
                 max_depth: int = MAX_JSON_DEPTH) -> None:
        self.app = app
        self.token = token.encode()
        self.max_bytes = max_bytes
        self.max_depth = max_depth

    def _authorized(self, headers: Headers) -> bool:
        scheme, _, credentials = headers.get("authorization", "").partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(credentials.strip().encode(), self.token)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        refusal = self._refuse_early(scope, headers)
        if refusal is None:
            chunks: list[bytes] = []
            size = 0
            while True:
                message = await receive()
                if message["type"] == "http.disconnect":
                    return
                chunk = message.get("body", b"")
                size += len(chunk)
                if size > self.max_bytes:
                    refusal = error_response(413, f"body larger than {self.max_bytes} bytes")
                    break
                chunks.append(chunk)
                if not message.get("more_body", False):
                    break
        if refusal is None:
            raw = b"".join(chunks)
            raw = b"" if not raw.strip() else raw  # whitespace only is an empty body
            refusal = self._refuse_json(scope, raw, headers)
        if refusal is not None:
            await refusal(scope, receive, send)
            return
        if raw and "content-type" not in headers:
            # A body without a Content-Type is JSON (as the API always took it), whatever FastAPI's
            # version assumes.
            scope = {**scope, "headers": [*scope["headers"], (b"content-type", b"application/json")]}
        replay: list[Message] = [{"type": "http.request", "body": raw, "more_body": False}]

        async def replayed() -> Message:
            return replay.pop() if replay else await receive()

        await self.app(scope, replayed, send)

    def _refuse_early(self, scope: Scope, headers: Headers) -> JSONResponse | None:
        if scope["path"] not in PUBLIC_PATHS and not self._authorized(headers):
            return error_response(401, "missing or wrong bearer token", headers={"WWW-Authenticate": "Bearer"})
        length = headers.get("content-length")
        if length is not None and not (length.isascii() and length.isdigit()):
            return error_response(400, "Content-Length is not a number")
        if length is not None and int(length) > self.max_bytes:
            return error_response(413, f"body of {int(length)} bytes is larger than {self.max_bytes} bytes")
        return None

    def _refuse_json(self, scope: Scope, raw: bytes, headers: Headers) -> JSONResponse | None:
        media = headers.get("content-type", "application/json").split(";")[0].strip().lower()
        if not raw:
            return None
        if not (media == "application/json" or media.endswith("+json")):
            if scope["method"] in ("POST", "PUT", "PATCH"):
                return error_response(415, f"the body must be JSON (Content-Type: application/json), not {media!r}")
            return None
        if json_too_deep(raw, self.max_depth):
            return error_response(400, f"body nests arrays/objects deeper than {self.max_depth} levels",
                                  code="too_deep")
        try:
            json.loads(raw)  # the route parses it again; this one may fail without consequences
        except (ValueError, RecursionError) as exc:  # JSONDecodeError, bad UTF-8, > 4300-digit integers
            return error_response(400, f"body is not valid JSON: {str(exc)[:200]}", code="bad_json")
        return None


# --- error handlers ------------------------------------------------------------------------------

# The union branch pydantic adds to a location ("constrained-int", "function-after[...]", "str"):
# not a field, so not part of the field's name.
_BRANCH_TAG = re.compile(r"^(int|str|float|bool|none|(constrained|function|json-or-python|lax|strict)-.*|\w+\[.*\])$")


def _field_name(loc: Sequence[int | str]) -> str:
    parts = [p for p in loc if isinstance(p, int) or not _BRANCH_TAG.match(p)]
    if parts and parts[0] in ("body", "path", "query", "header"):
        parts = parts[1:]
    return ".".join(str(p) for p in parts) or "<body>"


def _validation_error(request: Request, exc: RequestValidationError, body_required: dict[str, str]
                      ) -> JSONResponse:
    fields: list[FieldError] = []
    for err in exc.errors():
        if err.get("type") == "json_invalid":
            return error_response(400, "body is not valid JSON", code="bad_json")
        name = _field_name(err.get("loc", ()))
        if name == "<body>" and err.get("type") == "missing":
            route = request.scope.get("route")
            message = body_required.get(getattr(route, "name", ""), "a request body is required")
            return error_response(422, message, [FieldError(field="<body>", error="required")])
        fields.append(FieldError(field=name, error=str(err.get("msg", "invalid"))))
    summary = "; ".join(f"{f.field}: {f.error}" for f in fields)
    return error_response(422, f"invalid request: {summary}"[:1000], fields)


def install_error_handlers(app: FastAPI, body_required: dict[str, str]) -> None:
    """Every error answer becomes an ErrorBody; ``body_required`` maps a route name to the message
    for its missing body."""
    @app.exception_handler(RequestValidationError)
    async def _on_validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        return _validation_error(request, exc, body_required)

    @app.exception_handler(HTTPException)
    async def _on_http(_request: Request, exc: HTTPException) -> JSONResponse:
        detail = exc.detail if isinstance(exc.detail, str) else DESCRIPTIONS.get(exc.status_code, "error")
        return error_response(exc.status_code, detail, headers=dict(exc.headers or {}))

    @app.exception_handler(TransportError)
    async def _on_transport(_request: Request, exc: TransportError) -> JSONResponse:
        return error_response(503, f"a backing service did not answer: {exc}", headers={"Retry-After": "1"})

    @app.exception_handler(JobError)
    async def _on_job_error(_request: Request, exc: JobError) -> JSONResponse:
        return error_response(409, str(exc))

    @app.exception_handler(Exception)
    async def _on_crash(_request: Request, exc: Exception) -> JSONResponse:
        log.error("API request failed", exc_info=exc)
        return error_response(500, "internal error; see the controller log", code="internal")

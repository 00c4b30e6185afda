"""The REST API (FastAPI): submit and watch RL jobs, stop them, inject faults.

Every route except ``/healthz`` and the dashboard page needs ``Authorization: Bearer <token>``.
The OpenAPI document is the contract: request bodies are the pydantic models the server validates
with, every status code is declared, and every error has one shape, ``ErrorBody``. Before any
route (or FastAPI's JSON parser) sees a request, ``RequestGuard`` checks the token, refuses a body
over ``MAX_BODY_BYTES`` while it streams in, and refuses JSON nested deeper than
``MAX_JSON_DEPTH`` or not parseable at all. Nothing is stored for a rejected request.
"""

from __future__ import annotations

import hmac
import json
import logging
import re
import uuid
from collections.abc import Sequence
from pathlib import Path as FilePath
from typing import Annotated, Any

from fastapi import Body, Depends, FastAPI, Path, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, PlainTextResponse
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PlainValidator,
    StrictFloat,
    WithJsonSchema,
    model_validator,
)
from robustrl.services.controller.runtime import Controller
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from robustrl.chaos.scenario import target_problem
from robustrl.config import JobSpec
from robustrl.errors import ConfigError, JobError, LaunchError
from robustrl.messages import ChaosKind, ChaosRequest, ChaosRole

log = logging.getLogger(__name__)
STATIC = FilePath(__file__).parent / "static"
MAX_BODY_BYTES = 1 << 20
MAX_JSON_DEPTH = 32
"""A job spec nests 3 levels; anything deeper than this is refused before it is parsed."""
PUBLIC_PATHS = frozenset({"/healthz", "/dashboard", "/openapi.json", "/docs", "/docs/oauth2-redirect", "/redoc"})
JOB_ID_PATTERN = r"^[A-Za-z0-9_-]{1,64}$"
MEMBER_INDEX_MAX = 999
MEMBER_ID_PATTERN = r"^(?:[0-9]{1,3}|[a-z][a-z_]{0,31}(?:-[a-z0-9]{1,16}){1,3})$"
"""A member index as ASCII digits, or a member id such as ``rollout-0-i0`` / ``trainer-e1-r0``."""


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
         413: "body_too_large", 422: "validation_error", 503: "unavailable"}
DESCRIPTIONS = {400: "Body is not JSON, or nests too deep", 401: "Missing or wrong bearer token",
                404: "No such job", 405: "Method not allowed on this path",
                409: "The job's state forbids it, or this controller is a standby",
                413: f"Body larger than {MAX_BODY_BYTES} bytes", 422: "A field is invalid; each bad field is named",
                503: "Members could not be launched"}


def error_response(status: int, message: str, fields: Sequence[FieldError] = (), *, code: str | None = None,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    body = ErrorBody(error=ErrorDetail(code=code or CODES.get(status, f"http_{status}"), message=message,
                                       fields=list(fields)))
    return JSONResponse(body.model_dump(), status_code=status, headers=headers)


def _errors(*codes: int) -> dict[int | str, dict[str, Any]]:
    return {c: {"model": ErrorBody, "description": DESCRIPTIONS[c]} for c in codes}


ALWAYS = (400, 401, 405, 413)  # what RequestGuard and the router may answer on any protected route


# --- request and response bodies -----------------------------------------------------------------

def _member_ref(value: object) -> int | str:
    if isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= MEMBER_INDEX_MAX:
        return value
    if isinstance(value, str) and re.fullmatch(MEMBER_ID_PATTERN[1:-1], value):
        return int(value) if value.isdigit() else value  # ASCII digits only: the pattern says so
    raise ValueError(f"must be a member index 0..{MEMBER_INDEX_MAX} or a member id such as rollout-0-i0 "
                     "(ASCII letters, digits, '_' and '-')")


MemberRef = Annotated[int | str, PlainValidator(_member_ref), WithJsonSchema({"anyOf": [
    {"type": "integer", "minimum": 0, "maximum": MEMBER_INDEX_MAX},
    {"type": "string", "pattern": MEMBER_ID_PATTERN, "maxLength": 64}]})]


class FaultBody(BaseModel):
    """Body of ``POST /v1/jobs/{id}/faults``."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)
    kind: ChaosKind
    role: ChaosRole
    member: MemberRef = Field(0, description="Member index within the role, or member id.")
    duration_s: StrictFloat = Field(0.0, ge=0, le=3600)
    factor: StrictFloat = Field(4.0, ge=1.0, le=1000)

    @model_validator(mode="after")
    def _kind_fits_role(self) -> FaultBody:
        problem = target_problem(self.kind, self.role)  # the scenario format's rule
        if problem:
            raise ValueError(problem)
        return self


class FaultAccepted(BaseModel):
    fault_id: str
    member_id: str
    kind: str


class MemberStatus(BaseModel):
    model_config = ConfigDict(extra="allow")
    member_id: str
    role: str
    state: str


class JobStatus(BaseModel):
    """A job as ``GET /v1/jobs/{id}`` shows it (more fields than these may appear)."""

    model_config = ConfigDict(extra="allow")
    job_id: str
    name: str
    status: str
    step: int
    steps_total: int
    committed_step: int
    members: list[MemberStatus]


class Health(BaseModel):
    ok: bool
    nats: bool
    jobs: int


BEARER = HTTPBearer(auto_error=False)
JobId = Annotated[str, Path(pattern=JOB_ID_PATTERN, description="Job id as returned by POST /v1/jobs.")]
BODY_REQUIRED = {
    "submit": "a job spec is required: send a JSON object ({} selects every default)",
    "inject": "a fault request is required: a JSON object with kind and role",
}


# --- the guard in front of every route -----------------------------------------------------------

# A string runs to its closing quote or, unterminated, to the end of the body: a pattern that must
# find the closing quote retries from every later quote and is quadratic (1 MiB of \" = hours).
_JSON_STRING = re.compile(rb'"(?:[^"\\]++|\\.)*+\\?(?:"|\Z)', re.DOTALL)
_NOT_BRACKETS = bytes(sorted(set(range(256)) - set(b"[]{}")))
_INNERMOST = re.compile(rb"\[\]|\{\}")


def json_too_deep(data: bytes, max_depth: int) -> bool:
    """Whether ``data`` nests arrays/objects deeper than ``max_depth`` (or its brackets do not
    pair up), decided at C speed without parsing: strings are cut out, everything but brackets
    deleted, and the innermost ``[]``/``{}`` pairs removed once per level."""
    if data.count(b"[") + data.count(b"{") <= max_depth:
        return False
    rest = _JSON_STRING.sub(b"", data).translate(None, _NOT_BRACKETS)
    for _ in range(max_depth):
        shorter = _INNERMOST.sub(b"", rest)  # one pass: exactly one level per round
        if not shorter:
            return False
        if len(shorter) == len(rest):
            return True
        rest = shorter
    return True

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
            refusal = self._refuse_json(raw, headers)
        if refusal is not None:
            await refusal(scope, receive, send)
            return
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

    def _refuse_json(self, raw: bytes, headers: Headers) -> JSONResponse | None:
        media = headers.get("content-type", "application/json").split(";")[0].strip().lower()
        if not raw or not (media == "application/json" or media.endswith("+json")):
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

_BRANCH_TAG = re.compile(r"^(int|str|float|bool|none|list\[.*|dict\[.*|.*-.*|function-.*)$")


def _field_name(loc: Sequence[int | str]) -> str:
    parts = [p for p in loc if isinstance(p, int) or not _BRANCH_TAG.match(p)]
    if parts and parts[0] in ("body", "path", "query", "header"):
        parts = parts[1:]
    return ".".join(str(p) for p in parts) or "<body>"


def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    fields: list[FieldError] = []
    for err in exc.errors():
        if err.get("type") == "json_invalid":
            return error_response(400, "body is not valid JSON", code="bad_json")
        name = _field_name(err.get("loc", ()))
        if name == "<body>" and err.get("type") == "missing":
            route = request.scope.get("route")
            message = BODY_REQUIRED.get(getattr(route, "name", ""), "a request body is required")
            return error_response(422, message, [FieldError(field="<body>", error="required")])
        fields.append(FieldError(field=name, error=str(err.get("msg", "invalid"))))
    summary = "; ".join(f"{f.field}: {f.error}" for f in fields)
    return error_response(422, f"invalid request: {summary}"[:1000], fields)


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(RequestValidationError)
    async def _on_validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        return _validation_error(request, exc)

    @app.exception_handler(HTTPException)
    async def _on_http(_request: Request, exc: HTTPException) -> JSONResponse:
        detail = exc.detail if isinstance(exc.detail, str) else DESCRIPTIONS.get(exc.status_code, "error")
        return error_response(exc.status_code, detail, headers=dict(exc.headers or {}))

    @app.exception_handler(JobError)
    async def _on_job_error(_request: Request, exc: JobError) -> JSONResponse:
        return error_response(409, str(exc))

    @app.exception_handler(Exception)
    async def _on_crash(_request: Request, exc: Exception) -> JSONResponse:
        log.error("API request failed", exc_info=exc)
        return error_response(500, "internal error; see the controller log", code="internal")


# --- the app -------------------------------------------------------------------------------------

def create_app(controller: Controller, token: str) -> FastAPI:
    if not token:
        raise ConfigError("the API needs a token (ROBUSTRL_API_TOKEN)", field="api_token")
    app = FastAPI(title="RobustRL controller", version="0.1.0",
                  description="Submit RL post-training jobs, watch them, inject faults. Every error "
                              "answer is an ErrorBody.")
    app.add_middleware(RequestGuard, token=token)
    _install_error_handlers(app)
    def auth(creds: Annotated[HTTPAuthorizationCredentials | None, Depends(BEARER)]) -> None:
        # RequestGuard already refused a wrong token; this declares the scheme in OpenAPI and
        # guards a route mounted without the middleware.
        if creds is None or not hmac.compare_digest(creds.credentials.encode(), token.encode()):
            raise HTTPException(401, detail="missing or wrong bearer token", headers={"WWW-Authenticate": "Bearer"})

    def job_or_404(job_id: str) -> Any:
        try:
            return controller.get(job_id)
        except JobError as exc:
            raise HTTPException(404, detail=str(exc)) from exc

    guarded: dict[str, Any] = {"dependencies": [Depends(auth)], "response_model": None}

    @app.get("/healthz", response_model=None, responses={200: {"model": Health}, **_errors(400, 405, 413)})
    async def healthz() -> dict[str, Any]:
        return {"ok": True, "nats": controller.bus.connected, "jobs": len(controller.jobs)}

    @app.post("/v1/jobs", status_code=201, **guarded,
              responses={201: {"model": JobStatus, "description": "The job, started"},
                         **_errors(*ALWAYS, 409, 422, 503)})
    async def submit(spec: Annotated[JobSpec, Body(description="The job spec; {} selects every default.")]
                     ) -> dict[str, Any]:
        try:
            job = await controller.submit(spec)
        except LaunchError as exc:
            raise HTTPException(503, detail=str(exc)) from exc
        return job.status_dict()

    @app.get("/v1/jobs", **guarded, responses={200: {"model": list[JobStatus]}, **_errors(*ALWAYS)})
    async def list_jobs() -> list[dict[str, Any]]:
        return [j.status_dict() for j in controller.jobs.values()]

    @app.get("/v1/jobs/{job_id}", **guarded, responses={200: {"model": JobStatus}, **_errors(*ALWAYS, 404, 422)})
    async def get_job(job_id: JobId) -> dict[str, Any]:
        return job_or_404(job_id).status_dict()

    @app.get("/v1/jobs/{job_id}/events", **guarded,
             responses={200: {"model": list[dict[str, Any]], "description": "The job's event log, oldest first"},
                        **_errors(*ALWAYS, 404, 422)})
    async def events(job_id: JobId) -> list[dict[str, Any]]:
        job_or_404(job_id)
        return [e.model_dump(mode="json") for e in await controller.bus.read_events(job_id)]

    @app.get("/v1/jobs/{job_id}/report", **guarded,
             responses={200: {"model": dict[str, Any], "description": "Accounting from the event log"},
                        **_errors(*ALWAYS, 404, 422)})
    async def report(job_id: JobId) -> dict[str, Any]:
        from robustrl.chaos.accounting import account

        job = job_or_404(job_id)
        # The job's error (e.g. a member's last stderr lines when it cannot start) with the accounting.
        return {**account(await controller.bus.read_events(job_id)).to_dict(), "status": job.status,
                "error": job.error}

    @app.post("/v1/jobs/{job_id}/stop", **guarded,
              responses={200: {"model": JobStatus}, **_errors(*ALWAYS, 404, 409, 422)})
    async def stop(job_id: JobId) -> dict[str, Any]:
        job_or_404(job_id)
        return (await controller.stop_job(job_id, "stopped", "stopped through the API")).status_dict()

    @app.post("/v1/jobs/{job_id}/faults", status_code=202, **guarded,
              responses={202: {"model": FaultAccepted}, **_errors(*ALWAYS, 404, 409, 422)})
    async def inject(job_id: JobId, fault: Annotated[FaultBody, Body()]) -> dict[str, Any]:
        job_or_404(job_id)
        req = ChaosRequest(job_id=job_id, fault_id=f"api-{uuid.uuid4().hex[:8]}", kind=fault.kind,
                           role=fault.role, member=fault.member, duration_s=fault.duration_s,  # type: ignore[arg-type]
                           factor=fault.factor)
        try:
            member = await controller.inject(req)
        except JobError as exc:
            status = 409 if "is " in str(exc) and "job" in str(exc) else 422
            field = getattr(exc, "field", None)
            return error_response(status, str(exc), [FieldError(field=field, error=exc.message)] if field else ())
        return {"fault_id": req.fault_id, "member_id": member, "kind": req.kind}

    @app.get("/metrics", response_class=PlainTextResponse, **guarded,
             responses={200: {"content": {"text/plain": {"schema": {"type": "string"}}},
                              "description": "Prometheus text exposition format 0.0.4"},
                        **_errors(*ALWAYS)})
    async def metrics() -> PlainTextResponse:
        from robustrl.metrics import render_prometheus

        return PlainTextResponse(render_prometheus([j.status_dict() for j in controller.jobs.values()]),
                                 media_type="text/plain; version=0.0.4")

    @app.get("/dashboard", response_class=HTMLResponse, include_in_schema=False)
    async def dashboard() -> HTMLResponse:
        page = STATIC / "dashboard.html"
        if not page.exists():
            return HTMLResponse("<h1>dashboard not installed</h1>", status_code=404)
        return HTMLResponse(page.read_text())

    return app

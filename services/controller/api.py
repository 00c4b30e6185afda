"""The REST API (FastAPI): submit and watch RL jobs, stop them, inject faults.

Every route except ``/healthz`` and the dashboard page needs ``Authorization: Bearer <token>``.
The OpenAPI document is the contract: request bodies are the pydantic models the server validates
with, every status code is declared, and every error has one shape, ``ErrorBody``. Before any
route (or FastAPI's JSON parser) sees a request, ``edge.RequestGuard`` checks the token, the body
size (while it streams in) and the JSON nesting depth. Nothing is stored for a rejected request.
"""

from __future__ import annotations

import asyncio
import hmac
import re
import uuid
from pathlib import Path as FilePath
from typing import Annotated, Any

from fastapi import Body, Depends, FastAPI, Path, Query, Response
from fastapi.responses import HTMLResponse, PlainTextResponse
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from prometheus_client import generate_latest
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PlainValidator,
    StrictFloat,
    StringConstraints,
    ValidationInfo,
    WithJsonSchema,
    field_validator,
    model_validator,
)
from robustrl.services.controller.edge import (
    DESCRIPTIONS,
    ErrorBody,
    FieldError,
    RequestGuard,
    error_response,
    install_error_handlers,
)
from robustrl.services.controller.lease import LeaseLost
from robustrl.services.controller.retention import delete_at
from robustrl.services.controller.runtime import Controller
from starlette.exceptions import HTTPException

from robustrl.aio import within
from robustrl.chaos.scenario import moment_problem, target_problem
from robustrl.config import JobSpec
from robustrl.errors import ConfigError, JobActive, JobError, LaunchError, StorageError
from robustrl.messages import ChaosKind, ChaosMoment, ChaosRequest, ChaosRole
from robustrl.metrics import CONTENT_TYPE, controller_registry

STATIC = FilePath(__file__).parent / "static"
JOB_ID_PATTERN = r"^[A-Za-z0-9_-]{1,64}$"
MEMBER_INDEX_MAX = 999
MEMBER_ID_PATTERN = r"^(?:[0-9]{1,3}|[a-z][a-z_]{0,31}(?:-[a-z0-9]{1,16}){1,3})$"
"""A member index as ASCII digits, or a member id such as ``rollout-0-i0`` / ``trainer-e1-r0``."""


def _errors(*codes: int) -> dict[int | str, dict[str, Any]]:
    """OpenAPI ``responses`` entries: each code answered with an ErrorBody."""
    return {c: {"model": ErrorBody, "description": DESCRIPTIONS[c]} for c in codes}


ALWAYS = (400, 401, 405, 413, 503)  # what RequestGuard, the router and a lost bus may answer anywhere
SUBMIT_ANSWER_S = 5.0
"""``POST /v1/jobs`` answers 201 when the job's members started within this, else 202 (they go on
starting; the job's status follows them), well inside a client's usual timeout (10 s for ours)."""
EVENTS_READ_DEADLINE_S = 20.0
"""Bound on reading a job's event log for one request; past it the answer is 503."""


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
    against: list[Annotated[str, StringConstraints(pattern=r"^(h\d{1,3}|gw)$")]] = Field(
        default_factory=list, max_length=250,
        description="partition on a testbed: the hosts cut from the member's host (gw: infra and control "
                    "plane); empty: every other host and gw.")
    moment: ChaosMoment = Field("now", description=(
        "crash of a rollout replica only: 'mid_tool_turn' arms the replica to crash at the first token of "
        "the next turn it generates after a tool result (a turn in flight with its prefix saved), "
        "'mid_batch' at the first token of the next batch it decodes; armed for duration_s (0: an hour), "
        "after which an arming no such turn reached expires."))

    @field_validator("moment")
    @classmethod
    def _moment_fits_fault(cls, moment: str, info: ValidationInfo) -> str:
        kind, role = info.data.get("kind"), info.data.get("role")
        problem = moment_problem(kind, role, moment) if kind is not None and role is not None else None
        if problem:
            raise ValueError(problem)
        return moment

    @model_validator(mode="after")
    def _kind_fits_role(self) -> FaultBody:
        problem = target_problem(self.kind, self.role)
        if problem:
            raise ValueError(problem)
        return self


class FaultAccepted(BaseModel):
    fault_id: str
    member_id: str
    kind: str


class JobDeleted(BaseModel):
    job_id: str
    redis_keys_deleted: int = Field(description="The job's keys unlinked from Redis (episodes, prefixes, "
                                                "batches, fences, trained log, gang record, handled faults)")
    checkpoint_objects_deleted: int
    events_deleted: int
    checkpoints_kept: bool
    checkpoints_error: str | None = Field(None, description=(
        "Why the checkpoints asked for stayed (the object store refused their delete for good, e.g. a "
        "read-only key); the rest of the job was deleted"))
    events_kept: bool


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
    status: str = Field(description=(
        "pending (recorded; its first members still starting), running, recovering, finished, failed "
        "or stopped"))
    step: int
    steps_total: int
    committed_step: int
    members: list[MemberStatus]
    delete_at: float | None = Field(None, description=(
        "When the controller deletes the ended job (Unix time: its end plus retention.delete_after_s); "
        "null: kept until DELETE, or not ended yet"))


class Health(BaseModel):
    ok: bool
    nats: bool
    jobs: int
    leading: bool
    """False on a standby or while a restarted controller restores its jobs: job routes answer 503."""


BEARER = HTTPBearer(auto_error=False)
JobId = Annotated[str, Path(pattern=JOB_ID_PATTERN, description="Job id as returned by POST /v1/jobs.")]
BODY_REQUIRED = {
    "submit": "a job spec is required: send a JSON object ({} selects every default)",
    "inject": "a fault request is required: a JSON object with kind and role",
}


# --- the app -------------------------------------------------------------------------------------

def create_app(controller: Controller, token: str) -> FastAPI:
    if not token:
        raise ConfigError("the API needs a token (ROBUSTRL_API_TOKEN)", field="api_token")
    app = FastAPI(title="RobustRL controller", version="0.1.0",
                  description="Submit RL post-training jobs, watch them, inject faults. Every error "
                              "answer is an ErrorBody.")
    app.add_middleware(RequestGuard, token=token)
    install_error_handlers(app, BODY_REQUIRED)
    # Read at each scrape: the job dicts as GET /v1/jobs/{id} returns them.
    registry = controller_registry(lambda: [j.status_dict() for j in list(controller.jobs.values())])
    def auth(creds: Annotated[HTTPAuthorizationCredentials | None, Depends(BEARER)]) -> None:
        # RequestGuard already refused a wrong token; this declares the scheme in OpenAPI and
        # guards a route mounted without the middleware.
        if creds is None or not hmac.compare_digest(creds.credentials.encode(), token.encode()):
            raise HTTPException(401, detail="missing or wrong bearer token", headers={"WWW-Authenticate": "Bearer"})

    def leading_or_503() -> None:
        # A standby, or a restarted controller still restoring its jobs from the registry, holds
        # no jobs yet: "no such job" from it would tell a client a live job is gone (seen in the
        # campaign: a 404 for the running job while the controller restarted).
        if not controller.leading:
            raise HTTPException(503, detail="this controller is not leading (a standby, or restoring its jobs "
                                            "after a restart); retry shortly", headers={"Retry-After": "1"})

    def job_or_404(job_id: str) -> Any:
        try:
            return controller.get(job_id)
        except JobError as exc:
            raise HTTPException(404, detail=str(exc)) from exc

    async def read_events(job_id: str) -> Any:
        try:
            return await within(controller.bus.read_events(job_id), EVENTS_READ_DEADLINE_S)
        except TimeoutError as exc:
            raise HTTPException(503, detail=f"event log not read within {EVENTS_READ_DEADLINE_S:g}s") from exc

    guarded: dict[str, Any] = {"dependencies": [Depends(auth), Depends(leading_or_503)], "response_model": None}

    @app.get("/healthz", response_model=None, responses={200: {"model": Health}, **_errors(400, 405, 413)})
    async def healthz() -> dict[str, Any]:
        return {"ok": True, "nats": controller.bus.connected, "jobs": len(controller.jobs),
                "leading": controller.leading}

    @app.post("/v1/jobs", status_code=201, **guarded,
              responses={201: {"model": JobStatus, "description": "The job, its members started"},
                         202: {"model": JobStatus, "description": (
                             f"The job, recorded; its members still starting after {SUBMIT_ANSWER_S:.0f} s "
                             "(a Ray placement, container starts), or its start interrupted by a change of "
                             "leader (the next leader starts it): follow it with GET /v1/jobs/{id}")},
                         **_errors(*ALWAYS, 409, 415),
                         422: {"model": ErrorBody, "description": (
                             "A field is invalid (code validation_error, each bad field named); or the job "
                             "was recorded and its members could not be started (code launch_failed, the "
                             "message names the job, now failed: GET it for the reason). Not worth retrying "
                             "as it is: a new job would meet the same")}})
    async def submit(spec: Annotated[JobSpec, Body(description="The job spec; {} selects every default.")],
                     response: Response) -> dict[str, Any]:
        try:
            job = await controller.create_job(spec)
        except LeaseLost as exc:  # deposed as it recorded the job: nothing was started
            raise HTTPException(503, detail=f"not submitted: {exc}") from exc
        # Answered within SUBMIT_ANSWER_S whatever the launcher takes: a client that timed out on a
        # slow start would not know its job exists, and a retry would start a second one.
        launch = controller.launch_in_background(job)
        done, _ = await asyncio.wait({launch}, timeout=SUBMIT_ANSWER_S)
        if not done:
            response.status_code = 202
            return job.status_dict()
        # Recorded, its start cut short by this controller stopping or being deposed: the job exists
        # and the next leader starts it (a not-launched job is started again), so the answer is
        # the job, 202. A 503 said "try again", and a retried POST submitted a second job.
        exc = None if launch.cancelled() else launch.exception()
        if launch.cancelled() or isinstance(exc, LeaseLost):
            response.status_code = 202
            return job.status_dict()
        if isinstance(exc, LaunchError):  # the job is failed (its record and event log say why)
            return error_response(422, str(exc), code="launch_failed")
        if exc is not None:
            raise exc
        return job.status_dict()

    @app.get("/v1/jobs", **guarded, responses={200: {"model": list[JobStatus]}, **_errors(*ALWAYS)})
    async def list_jobs() -> list[dict[str, Any]]:
        return [{**j.status_dict(), "delete_at": delete_at(j)} for j in controller.jobs.values()]

    @app.get("/v1/jobs/{job_id}", **guarded, responses={200: {"model": JobStatus}, **_errors(*ALWAYS, 404, 422)})
    async def get_job(job_id: JobId) -> dict[str, Any]:
        job = job_or_404(job_id)
        return {**job.status_dict(), "delete_at": delete_at(job)}

    @app.get("/v1/jobs/{job_id}/events", **guarded,
             responses={200: {"model": list[dict[str, Any]], "description": "The job's event log, oldest first"},
                        **_errors(*ALWAYS, 404, 422)})
    async def events(job_id: JobId) -> list[dict[str, Any]]:
        job_or_404(job_id)
        return [e.model_dump(mode="json") for e in await read_events(job_id)]

    @app.get("/v1/jobs/{job_id}/report", **guarded,
             responses={200: {"model": dict[str, Any], "description": "Accounting from the event log"},
                        **_errors(*ALWAYS, 404, 422)})
    async def report(job_id: JobId) -> dict[str, Any]:
        from robustrl.chaos.accounting import account

        job = job_or_404(job_id)
        # The job's error (e.g. a member's last stderr lines when it cannot start) with the accounting.
        return {**account(await read_events(job_id)).to_dict(), "status": job.status,
                "error": job.error}

    @app.post("/v1/jobs/{job_id}/stop", **guarded,
              responses={200: {"model": JobStatus}, **_errors(*ALWAYS, 404, 409, 415, 422)})
    async def stop(job_id: JobId) -> dict[str, Any]:
        job_or_404(job_id)
        try:
            return (await controller.stop_job(job_id, "stopped", "stopped through the API")).status_dict()
        except LeaseLost as exc:  # deposed during the stop: the new leader runs the job; ask it again
            raise HTTPException(503, detail=f"not stopped: {exc}; repeat the request") from exc

    @app.delete("/v1/jobs/{job_id}", **guarded,
                responses={200: {"model": JobDeleted, "description": "Deleted: GET answers 404 from now on"},
                           **_errors(*ALWAYS, 404, 422),
                           409: {"model": ErrorBody, "description": "The job has not ended: stop it first"}})
    async def delete_job(job_id: JobId,
                         checkpoints: Annotated[bool, Query(description=(
                             "Also delete its checkpoints (the trained model) from the object store"))] = False,
                         events: Annotated[bool, Query(description=(
                             "Also delete its event log (else the log is kept and ends with job_deleted)"))] = False,
                         ) -> dict[str, Any]:
        try:
            return await controller.delete_job(job_id, checkpoints=checkpoints, events=events)
        except JobActive as exc:
            return error_response(409, str(exc))  # type: ignore[return-value]
        except JobError as exc:
            raise HTTPException(404, detail=str(exc)) from exc
        except LeaseLost as exc:
            raise HTTPException(503, detail=f"not deleted: {exc}") from exc
        except StorageError as exc:  # the job stays marked: a repeated request finishes it
            raise HTTPException(503, detail=f"deletion not finished: {exc}; repeat the request") from exc

    @app.post("/v1/jobs/{job_id}/faults", status_code=202, **guarded,
              responses={202: {"model": FaultAccepted}, **_errors(*ALWAYS, 404, 409, 415, 422)})
    async def inject(job_id: JobId, fault: Annotated[FaultBody, Body()]) -> dict[str, Any]:
        job_or_404(job_id)
        req = ChaosRequest(job_id=job_id, fault_id=f"api-{uuid.uuid4().hex[:8]}", kind=fault.kind,
                           role=fault.role, member=fault.member, duration_s=fault.duration_s,  # type: ignore[arg-type]
                           factor=fault.factor, against=fault.against, moment=fault.moment)
        try:
            member = await controller.inject(req)
        except JobError as exc:
            status = 409 if "is " in str(exc) and "job" in str(exc) else 422
            field = getattr(exc, "field", None)
            return error_response(status, str(exc), [FieldError(field=field, error=exc.message)] if field else ())
        except LaunchError as exc:  # the launcher could not act on the member (the fault is logged injected)
            return error_response(503, f"fault {req.fault_id} logged but not carried out: {exc}")
        return {"fault_id": req.fault_id, "member_id": member, "kind": req.kind}

    @app.get("/metrics", response_class=PlainTextResponse, dependencies=[Depends(auth)], response_model=None,
             responses={200: {"content": {"text/plain": {"schema": {"type": "string"}}},
                              "description": "Prometheus text exposition format 0.0.4"},
                        **_errors(*ALWAYS)})
    async def metrics() -> PlainTextResponse:
        return PlainTextResponse(generate_latest(registry), media_type=CONTENT_TYPE)

    @app.get("/dashboard", response_class=HTMLResponse, include_in_schema=False)
    async def dashboard() -> HTMLResponse:
        page = STATIC / "dashboard.html"
        if not page.exists():
            return HTMLResponse("<h1>dashboard not installed</h1>", status_code=404)
        return HTMLResponse(page.read_text())

    return app

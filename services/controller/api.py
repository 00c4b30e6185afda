"""The REST API (FastAPI): submit and watch RL jobs, stop them, inject faults.

Every route except ``/healthz`` and the dashboard page needs ``Authorization: Bearer <token>``.
Bad bodies get 4xx with each bad field named; nothing is stored for a rejected request.
"""

from __future__ import annotations

import hmac
import json
import uuid
from pathlib import Path
from typing import Any

from fastapi import Depends, FastAPI, HTTPException, Request
from fastapi.responses import HTMLResponse, JSONResponse, PlainTextResponse
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from robustrl.config import JobSpec
from robustrl.errors import ConfigError, JobError, LaunchError
from robustrl.messages import ChaosKind, ChaosRequest
from robustrl.services.controller.runtime import Controller

STATIC = Path(__file__).parent / "static"
MAX_BODY_BYTES = 1 << 20


class FaultBody(BaseModel):
    """Body of ``POST /v1/jobs/{id}/faults``."""

    model_config = ConfigDict(extra="forbid")
    kind: ChaosKind
    role: str = Field(pattern=r"^(trainer|rollout|request_manager)$")
    member: int | str = 0
    duration_s: float = Field(0.0, ge=0, le=3600)
    factor: float = Field(4.0, ge=1.0, le=1000)


def _field_errors(exc: ValidationError) -> list[dict[str, str]]:
    return [{"field": ".".join(str(p) for p in e["loc"]) or "<body>", "error": e["msg"]} for e in exc.errors()]


async def _json_body(request: Request) -> Any:
    raw = await request.body()
    if len(raw) > MAX_BODY_BYTES:
        raise HTTPException(413, detail=f"body larger than {MAX_BODY_BYTES} bytes")
    try:
        return json.loads(raw or b"{}")
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise HTTPException(400, detail=f"body is not valid JSON: {exc}") from exc


def create_app(controller: Controller, token: str) -> FastAPI:
    if not token:
        raise ConfigError("the API needs a token (ROBUSTRL_API_TOKEN)", field="api_token")
    app = FastAPI(title="RobustRL controller", version="0.1.0",
                  description="Submit RL post-training jobs, watch them, inject faults.")
    bearer = HTTPBearer(auto_error=False)

    def auth(creds: HTTPAuthorizationCredentials | None = Depends(bearer)) -> None:
        if creds is None or not hmac.compare_digest(creds.credentials.encode(), token.encode()):
            raise HTTPException(401, detail="missing or wrong bearer token", headers={"WWW-Authenticate": "Bearer"})

    def job_or_404(job_id: str) -> Any:
        try:
            return controller.get(job_id)
        except JobError as exc:
            raise HTTPException(404, detail=str(exc)) from exc

    @app.get("/healthz")
    async def healthz() -> dict[str, Any]:
        return {"ok": True, "nats": controller.bus.connected, "jobs": len(controller.jobs)}

    @app.post("/v1/jobs", status_code=201, dependencies=[Depends(auth)])
    async def submit(request: Request) -> dict[str, Any]:
        body = await _json_body(request)
        if not isinstance(body, dict):
            raise HTTPException(422, detail=[{"field": "<body>", "error": "expected a JSON object (the job spec)"}])
        try:
            spec = JobSpec.model_validate(body)
        except ValidationError as exc:
            raise HTTPException(422, detail=_field_errors(exc)) from exc
        try:
            job = await controller.submit(spec)
        except LaunchError as exc:
            raise HTTPException(503, detail=str(exc)) from exc
        return job.status_dict()

    @app.get("/v1/jobs", dependencies=[Depends(auth)])
    async def list_jobs() -> list[dict[str, Any]]:
        return [j.status_dict() for j in controller.jobs.values()]

    @app.get("/v1/jobs/{job_id}", dependencies=[Depends(auth)])
    async def get_job(job_id: str) -> dict[str, Any]:
        return job_or_404(job_id).status_dict()

    @app.get("/v1/jobs/{job_id}/events", dependencies=[Depends(auth)])
    async def events(job_id: str) -> list[dict[str, Any]]:
        job_or_404(job_id)
        return [e.model_dump(mode="json") for e in await controller.bus.read_events(job_id)]

    @app.get("/v1/jobs/{job_id}/report", dependencies=[Depends(auth)])
    async def report(job_id: str) -> dict[str, Any]:
        from robustrl.chaos.accounting import account

        job_or_404(job_id)
        return account(await controller.bus.read_events(job_id)).to_dict()

    @app.post("/v1/jobs/{job_id}/stop", dependencies=[Depends(auth)])
    async def stop(job_id: str) -> dict[str, Any]:
        job_or_404(job_id)
        return (await controller.stop_job(job_id, "stopped", "stopped through the API")).status_dict()

    @app.post("/v1/jobs/{job_id}/faults", status_code=202, dependencies=[Depends(auth)])
    async def inject(job_id: str, request: Request) -> dict[str, Any]:
        job_or_404(job_id)
        body = await _json_body(request)
        try:
            fault = FaultBody.model_validate(body)
        except ValidationError as exc:
            raise HTTPException(422, detail=_field_errors(exc)) from exc
        req = ChaosRequest(job_id=job_id, fault_id=f"api-{uuid.uuid4().hex[:8]}", kind=fault.kind,
                           role=fault.role, member=fault.member, duration_s=fault.duration_s,  # type: ignore[arg-type]
                           factor=fault.factor)
        try:
            member = await controller.inject(req)
        except JobError as exc:
            raise HTTPException(409 if "is " in str(exc) and "job" in str(exc) else 422, detail=str(exc)) from exc
        return {"fault_id": req.fault_id, "member_id": member, "kind": req.kind}

    @app.get("/metrics", dependencies=[Depends(auth)])
    async def metrics() -> PlainTextResponse:
        from robustrl.metrics import render_prometheus

        return PlainTextResponse(render_prometheus([j.status_dict() for j in controller.jobs.values()]),
                                 media_type="text/plain; version=0.0.4")

    @app.get("/dashboard", response_class=HTMLResponse)
    async def dashboard() -> HTMLResponse:
        page = STATIC / "dashboard.html"
        if not page.exists():
            return HTMLResponse("<h1>dashboard not installed</h1>", status_code=404)
        return HTMLResponse(page.read_text())

    @app.exception_handler(JobError)
    async def _job_error(_request: Request, exc: JobError) -> JSONResponse:
        return JSONResponse({"detail": str(exc)}, status_code=409)

    return app

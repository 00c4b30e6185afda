"""A small client for the controller's REST API (used by the CLI, tests and benchmarks)."""

from __future__ import annotations

import time
from typing import Any

import httpx

from robustrl.errors import JobError, RequestTimeout, SubjectError, TransportError
from robustrl.subjects import token

HTTP_TIMEOUT_S = 10.0
"""How long a request waits for the controller's answer (a stop or a deletion: ``SLOW_CALL_S``)."""
SLOW_CALL_S = 120.0
"""How long a stop or a deletion waits for its answer. The controller answers a stop once it is
carried out: the request manager's acknowledgement (up to 12 s while it drains its log), the
event outboxes settled (up to 30 s with JetStream away), the members stopped (3 s grace), the
final event stored (up to 30 s); a deletion waits for a stop under way. Under load a stop took
over 10 s (tests/test_standby.py on a busy machine), and the client said the controller was
unreachable while the stop went on."""


def _error_text(resp: httpx.Response) -> str:
    """The message of the API's ErrorBody (it names every bad field); the raw text otherwise."""
    try:
        return str(resp.json()["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return resp.text[:2000]


class ApiClient:
    def __init__(self, base_url: str, token: str, timeout: float = HTTP_TIMEOUT_S) -> None:
        self.base_url = base_url.rstrip("/")
        # a slow call waits longer for its answer, not for the connection (a dead host fails as soon)
        self._slow = httpx.Timeout(SLOW_CALL_S, connect=timeout)
        self._http = httpx.Client(base_url=self.base_url, timeout=timeout,
                                  headers={"Authorization": f"Bearer {token}"})

    def _call(self, method: str, path: str, **kw: Any) -> Any:
        try:
            resp = self._http.request(method, path, **kw)
        except (httpx.ReadTimeout, httpx.WriteTimeout) as exc:  # (a connect timeout: unreachable, below)
            timeout = kw.get("timeout") or self._http.timeout
            limit = timeout.read if isinstance(timeout, httpx.Timeout) else timeout
            within = f" within {limit:g}s" if limit is not None else ""
            raise RequestTimeout(f"controller at {self.base_url} did not answer {method} {path}{within} "
                                 f"({type(exc).__name__}); what was asked may still be under way",
                                 url=self.base_url) from exc
        except httpx.HTTPError as exc:
            raise TransportError(f"controller at {self.base_url} unreachable: {exc}; is the stack up "
                                 "(robustrl up)?", url=self.base_url) from exc
        if resp.status_code >= 400:
            raise JobError(f"{method} {path} -> {resp.status_code}: {_error_text(resp)}", status=resp.status_code)
        return resp.json()

    @staticmethod
    def _job(job_id: str) -> str:
        """``/v1/jobs/<job_id>``, the id checked first: one like ``../x`` or ``x?y`` would
        otherwise name another job once the URL is built.

        Raises:
            JobError: not a job id (``field``: job_id).
        """
        try:
            return f"/v1/jobs/{token(job_id, 'job_id')}"
        except SubjectError as exc:
            raise JobError(f"not a job id: {str(job_id)[:100]!r} (letters, digits, '_' and '-', at most 64)",
                           field="job_id") from exc

    def submit(self, spec: dict[str, Any]) -> dict[str, Any]:
        return self._call("POST", "/v1/jobs", json=spec)

    def jobs(self) -> list[dict[str, Any]]:
        return self._call("GET", "/v1/jobs")

    def job(self, job_id: str) -> dict[str, Any]:
        return self._call("GET", self._job(job_id))

    def events(self, job_id: str) -> list[dict[str, Any]]:
        return self._call("GET", f"{self._job(job_id)}/events")

    def report(self, job_id: str) -> dict[str, Any]:
        return self._call("GET", f"{self._job(job_id)}/report")

    def stop(self, job_id: str) -> dict[str, Any]:
        return self._call("POST", f"{self._job(job_id)}/stop", timeout=self._slow)

    def delete(self, job_id: str, *, checkpoints: bool = False, events: bool = False) -> dict[str, Any]:
        """Delete an ended job (its Redis state and record; checkpoints and event log on request)."""
        return self._call("DELETE", self._job(job_id),
                          params={"checkpoints": str(checkpoints).lower(), "events": str(events).lower()},
                          timeout=self._slow)

    def fault(self, job_id: str, **body: Any) -> dict[str, Any]:
        return self._call("POST", f"{self._job(job_id)}/faults", json=body)

    def wait(self, job_id: str, predicate: Any, timeout_s: float, interval_s: float = 0.1) -> dict[str, Any]:
        """Poll the job until ``predicate(status)`` holds; raise RequestTimeout after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while True:
            status = self.job(job_id)
            if predicate(status):
                return status
            if time.monotonic() > deadline:
                raise RequestTimeout(f"job {job_id} did not reach the expected state within {timeout_s:.0f}s "
                                     f"(status {status['status']}, step {status['step']})")
            time.sleep(interval_s)

    def close(self) -> None:
        self._http.close()

"""The dashboard page in a real headless Chromium, against a stand-in JSON API.

The page (services/controller/static/dashboard.html) is served by a tiny FastAPI app on
127.0.0.1 that mimics the controller's ``/v1/jobs`` endpoints with a mutable job dict; the test
changes that dict and waits (bounded, no sleeps) until the page shows the change.

Needs Debian's ``chromium`` and ``chromium-driver`` plus ``selenium`` from PyPI; skipped with the
reason printed when they are missing.
"""

from __future__ import annotations

import copy
import os
import shutil
import socket
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated, Any

import pytest
import uvicorn
from fastapi import Depends, FastAPI, HTTPException
from fastapi.responses import HTMLResponse
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "services" / "controller" / "static" / "dashboard.html"
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"
TOKEN = "dash-test-token-3f9a"
WAIT_S = 15.0


def _missing() -> str | None:
    if not Path(CHROMIUM).exists():
        return "chromium not installed (apt-get install -y chromium chromium-driver)"
    if not Path(CHROMEDRIVER).exists():
        return "chromedriver not installed (apt-get install -y chromium-driver)"
    try:
        import selenium  # noqa: F401
    except ImportError:
        return "selenium not installed (pip install selenium)"
    return None


REASON = _missing()
if REASON:
    print(f"test_dashboard_browser skipped: {REASON}")
pytestmark = pytest.mark.skipif(REASON is not None, reason=REASON or "")


def _job(now: float) -> dict[str, Any]:
    return {
        "job_id": "job-abc", "name": "reference", "status": "running", "policy": "role_local",
        "step": 3, "steps_total": 30, "weights_version": 3, "reward_by_step": [0.1, 0.15, 0.2],
        "members": [
            {"member_id": "trainer-e1-r0", "role": "trainer", "state": "running", "phase": "training",
             "weights_version": 3},
            {"member_id": "trainer-e1-r1", "role": "trainer", "state": "running", "phase": "training",
             "weights_version": 3},
            {"member_id": "rollout-0", "role": "rollout", "state": "running", "phase": "serving",
             "weights_version": 3},
            {"member_id": "rollout-1", "role": "rollout", "state": "running", "phase": "serving",
             "weights_version": 3},
        ],
        "faults": [], "ettr": 0.95, "created_at": now - 60, "started_at": now - 58, "finished_at": None,
        "last_step_timings": {"generation_s": 1.0, "weight_sync_s": 0.05},
    }


class StandIn:
    """The mutable state behind the stand-in API, shared with the server thread."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.job = _job(time.time())
        self.events: list[dict[str, Any]] = [{"job_id": "job-abc", "kind": "job_started", "ts": time.time(),
                                              "data": {}}]
        self.unauthorized = 0

    def update(self, **changes: Any) -> None:
        with self.lock:
            self.job.update(changes)

    def snapshot(self) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        with self.lock:
            return copy.deepcopy(self.job), list(self.events)


# Module level: with postponed annotations FastAPI resolves ``Depends(...)`` from module globals.
_BEARER = HTTPBearer(auto_error=False)


def _app(state: StandIn) -> FastAPI:
    app = FastAPI()

    def auth(creds: Annotated[HTTPAuthorizationCredentials | None, Depends(_BEARER)]) -> None:
        if creds is None or creds.credentials != TOKEN:
            state.unauthorized += 1
            raise HTTPException(401, "bad token")

    @app.get("/dashboard", response_class=HTMLResponse)
    def dashboard() -> HTMLResponse:
        return HTMLResponse(PAGE.read_text())

    @app.get("/v1/jobs", dependencies=[Depends(auth)])
    def jobs() -> list[dict[str, Any]]:
        return [state.snapshot()[0]]

    @app.get("/v1/jobs/{job_id}", dependencies=[Depends(auth)])
    def job(job_id: str) -> dict[str, Any]:
        return state.snapshot()[0]

    @app.get("/v1/jobs/{job_id}/events", dependencies=[Depends(auth)])
    def events(job_id: str) -> list[dict[str, Any]]:
        return state.snapshot()[1]

    return app


@pytest.fixture
def server() -> Iterator[tuple[str, StandIn]]:
    state = StandIn()
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    srv = uvicorn.Server(uvicorn.Config(_app(state), log_level="warning", lifespan="off"))
    thread = threading.Thread(target=srv.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not srv.started:
        assert time.monotonic() < deadline and thread.is_alive(), "stand-in API did not start"
        time.sleep(0.01)  # bounded readiness poll of an in-process flag
    try:
        yield f"http://127.0.0.1:{port}", state
    finally:
        srv.should_exit = True
        thread.join(timeout=10)
        sock.close()


@pytest.fixture
def browser() -> Iterator[Any]:
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    # Never let Selenium Manager try to download a driver or browser: there is no network.
    os.environ.setdefault("SE_OFFLINE", "true")
    profile = tempfile.mkdtemp(prefix="rr-chromium-")
    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for flag in ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 "--disable-dev-shm-usage", f"--user-data-dir={profile}", "--window-size=1280,900"):
        opts.add_argument(flag)
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=opts)
    driver.set_page_load_timeout(WAIT_S)
    try:
        yield driver
    finally:
        driver.quit()
        shutil.rmtree(profile, ignore_errors=True)


def _wait(driver: Any, what: str, predicate: Any) -> Any:
    from selenium.webdriver.support.ui import WebDriverWait

    return WebDriverWait(driver, WAIT_S, poll_frequency=0.1).until(predicate, message=f"waited for {what}")


# The page re-renders every second, so element handles go stale: read the DOM in one JS call.
def _attr(driver: Any, css: str, name: str) -> str | None:
    return driver.execute_script(
        "const e = document.querySelector(arguments[0]); return e ? e.getAttribute(arguments[1]) : null;",
        css, name)


def _all_attr(driver: Any, css: str, name: str) -> list[str]:
    return driver.execute_script(
        "return [...document.querySelectorAll(arguments[0])].map((e) => e.getAttribute(arguments[1]));",
        css, name)


def _text(driver: Any, css: str) -> str:
    return driver.execute_script(
        "const e = document.querySelector(arguments[0]); return e ? e.textContent : '';", css)


def _count(driver: Any, css: str) -> int:
    return driver.execute_script("return document.querySelectorAll(arguments[0]).length;", css)


def test_dashboard_shows_job_then_fault_and_recovery(server: tuple[str, StandIn], browser: Any) -> None:
    from selenium.webdriver.common.by import By

    base, state = server
    browser.get(f"{base}/dashboard")
    assert _attr(browser, "#conn-status", "data-state") == "no-token"
    assert state.unauthorized == 0  # no request goes out without a token

    # A wrong token is rejected and shown as such.
    browser.find_element(By.ID, "token").send_keys("wrong")
    browser.find_element(By.ID, "token-save").click()
    _wait(browser, "token rejected", lambda d: _attr(d, "#conn-status", "data-state") == "unauthorized")

    browser.find_element(By.ID, "token").send_keys(TOKEN)
    browser.find_element(By.ID, "token-save").click()
    _wait(browser, "running job row", lambda d: _attr(d, '#jobs tr[data-job-id="job-abc"]', "data-status") == "running")
    assert browser.find_element(By.ID, "token").get_attribute("value") == ""
    assert TOKEN not in browser.page_source  # kept in sessionStorage only, never rendered
    assert browser.execute_script("return sessionStorage.getItem('robustrl.apiToken')") == TOKEN

    # The jobs table renders before the job's detail request returns: wait for the detail too.
    _wait(browser, "job detail", lambda d: _attr(d, "#conn-status", "data-state") == "ok"
          and _count(d, "#members li[data-member-id]") == 4)
    assert set(_all_attr(browser, "#members li[data-member-id]", "data-member-id")) == {
        "trainer-e1-r0", "trainer-e1-r1", "rollout-0", "rollout-1"}
    assert set(_all_attr(browser, "#members li[data-member-id]", "data-role")) == {"trainer", "rollout"}
    assert _attr(browser, "#reward-curve", "data-points") == "3"
    assert _attr(browser, "#ettr", "data-value") == "0.95"
    assert _count(browser, "#reward-curve polyline") == 1

    # A rollout crashes: the controller records the fault, the member exits, the job recovers.
    now = time.time()
    fault = {"fault_id": "f-1", "kind": "crash", "role": "rollout", "member_id": "rollout-1", "step": 4,
             "detected_at": now, "detection_s": 0.7, "recovery_s": None}
    job, _ = state.snapshot()
    job["members"][3]["state"] = "exited"
    with state.lock:
        state.events.append({"job_id": "job-abc", "kind": "fault_detected", "ts": now, "data": {"fault_id": "f-1"}})
    state.update(status="recovering", faults=[fault], members=job["members"], step=4,
                 reward_by_step=[0.1, 0.15, 0.2, 0.22])
    _wait(browser, "fault shown, not yet recovered",
          lambda d: _attr(d, '#faults li[data-fault-id="f-1"]', "data-recovered") == "false")
    assert _attr(browser, '#faults li[data-fault-id="f-1"]', "data-kind") == "crash"
    _wait(browser, "job recovering", lambda d: _attr(d, "#job-status", "data-status") == "recovering")
    assert _attr(browser, '#members li[data-member-id="rollout-1"]', "data-state") == "exited"
    _wait(browser, "fault event", lambda d: _count(d, '#events li[data-kind="fault_detected"]') == 1)

    # Recovery: a replacement replica joins, the fault gets its recovery time, ETTR drops.
    job, _ = state.snapshot()
    job["members"][3] = {"member_id": "rollout-1b", "role": "rollout", "state": "running",
                         "phase": "serving", "weights_version": 4}
    state.update(status="running", faults=[{**fault, "recovery_s": 3.5}], members=job["members"], ettr=0.9,
                 step=5, reward_by_step=[0.1, 0.15, 0.2, 0.22, 0.3])
    _wait(browser, "fault recovered",
          lambda d: _attr(d, '#faults li[data-fault-id="f-1"]', "data-recovered") == "true")
    text = _text(browser, '#faults li[data-fault-id="f-1"]')
    assert "recovered in 3.50 s" in text and "0.70 s" in text
    _wait(browser, "job running again", lambda d: _attr(d, "#job-status", "data-status") == "running")
    assert _attr(browser, '#members li[data-member-id="rollout-1b"]', "data-state") == "running"
    assert _attr(browser, "#ettr", "data-value") == "0.9"
    assert _attr(browser, "#reward-curve", "data-points") == "5"
    assert _count(browser, '#fault-timeline rect[data-fault-id="f-1"]') == 1
    # No script error at any point (a syntax error would leave the page blank but "passing").
    errors = [e for e in browser.get_log("browser") if e.get("source") == "javascript"]
    assert errors == []

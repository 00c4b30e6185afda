"""The dashboard page in a real headless Chromium, against the real controller.

The session's stack (controller, detector, request manager as processes on real NATS, Redis and
S3 servers) runs a small job; the test opens ``{api_url}/dashboard``, enters the token, injects a
rollout crash through the REST API and waits (bounded, no sleeps) until the page shows the job,
its members, the fault and then its recovery.

Needs Debian's ``chromium`` and ``chromium-driver`` plus ``selenium`` from PyPI; skipped with the
reason printed when they are missing.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from jobs import small_job, wait_step
from support import wait_for_setup

from robustrl.client import ApiClient

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"
WAIT_S = 20.0  # one page refresh is 1 s; the machine may be loaded
RECOVERY_WAIT_S = 90.0  # a replacement replica starts a Python process and pulls weights
# Never reached: the test stops the job once it has seen what it needs. A short job can end
# before a loaded machine has started the replacement replica, and then nothing recovers.
STEPS = 60


def _missing() -> str | None:
    not_set_up = wait_for_setup("apt")  # (scripts/test.sh installs chromium beside the suite)
    if not_set_up:
        return not_set_up
    if not Path(CHROMIUM).exists():
        return "chromium not installed (apt-get install -y chromium chromium-driver)"
    if not Path(CHROMEDRIVER).exists():
        return "chromedriver not installed (apt-get install -y chromium-driver)"
    try:
        import selenium  # noqa: F401
    except ImportError:
        return "selenium not installed (pip install selenium)"
    return None


# The test's own time (func_only): its fixture may first wait for the browser's install
# (scripts/test.sh runs it beside the suite; wait_for_setup bounds that wait).
pytestmark = pytest.mark.timeout(150, func_only=True)


@pytest.fixture(scope="module", autouse=True)
def _browser_installed() -> None:
    """Skip, with the reason printed, without a browser (looked for when the module's tests
    run, not at collection: ``scripts/test.sh`` may still be installing it then)."""
    reason = _missing()
    if reason:
        print(f"test_dashboard_browser skipped: {reason}")
        pytest.skip(reason)


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


def _wait(driver: Any, what: str, predicate: Callable[[Any], Any], timeout: float = WAIT_S) -> Any:
    from selenium.webdriver.support.ui import WebDriverWait

    return WebDriverWait(driver, timeout, poll_frequency=0.1).until(predicate, message=f"waited for {what}")


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


def _click(driver: Any, css: str) -> bool:
    return driver.execute_script(
        "const e = document.querySelector(arguments[0]); if (e) e.click(); return !!e;", css)


def test_dashboard_shows_real_job_fault_and_recovery(stack: Any, api: ApiClient, browser: Any) -> None:
    from selenium.webdriver.common.by import By

    token = stack.settings.api_token
    # Tool calls with latency make the episodes multi-turn, as in the rollout-crash recovery test.
    jid = api.submit(small_job("dash", steps=STEPS, tools={"latency_s": 0.5}, data={"tasks": ["lookup"]}))["job_id"]
    try:
        browser.get(f"{stack.api_url}/dashboard")
        assert _attr(browser, "#conn-status", "data-state") == "no-token"

        # A wrong token is rejected and shown as such.
        browser.find_element(By.ID, "token").send_keys("wrong")
        browser.find_element(By.ID, "token-save").click()
        _wait(browser, "token rejected", lambda d: _attr(d, "#conn-status", "data-state") == "unauthorized")

        browser.find_element(By.ID, "token").send_keys(token)
        browser.find_element(By.ID, "token-save").click()
        row = f'#jobs tr[data-job-id="{jid}"]'
        _wait(browser, "job row", lambda d: _attr(d, row, "data-status") in ("pending", "running"))
        assert browser.find_element(By.ID, "token").get_attribute("value") == ""
        assert token not in browser.page_source  # kept in sessionStorage only, never rendered
        # Other tests' jobs share the stack: select ours explicitly.
        assert _click(browser, row)
        _wait(browser, "job selected", lambda d: _attr(d, "#job-detail", "data-job-id") == jid)

        # The running job with its trainer gang and both replicas.
        wait_step(api, jid, 1)  # past the first step: a fault there would escalate to a job restart
        expected = {"trainer-e1-r0", "trainer-e1-r1", "rollout-0-i0", "rollout-1-i0"}
        _wait(browser, "job running with its members",
              lambda d: _attr(d, "#job-status", "data-status") == "running"
              and set(_all_attr(d, "#members li[data-member-id]", "data-member-id")) == expected)
        assert set(_all_attr(browser, "#members li[data-member-id]", "data-role")) == {"trainer", "rollout"}
        assert _count(browser, "#faults li") == 0

        # A rollout crash through the API: the page shows the fault, the dead member, the event.
        crashed = api.fault(jid, kind="crash", role="rollout", member=0)["member_id"]
        assert crashed == "rollout-0-i0"
        fault = f'#faults li[data-member-id="{crashed}"][data-kind="crash"]'
        # Shown (not recovered yet, or already: a replica forked from the zygote can be in before
        # the page's next poll).
        _wait(browser, "fault shown", lambda d: _attr(d, fault, "data-recovered") in ("false", "true"))
        assert _attr(browser, fault, "data-role") == "rollout"
        # "exited" when its exit is seen, "dead" once the controller has replaced it.
        _wait(browser, "crashed member shown down",
              lambda d: _attr(d, f'#members li[data-member-id="{crashed}"]', "data-state") in ("exited", "dead"))
        _wait(browser, "fault event", lambda d: _count(d, '#events li[data-kind="fault_detected"]') >= 1)

        # Recovery: the replacement joins, the fault gets its recovery time and a timeline bar.
        _wait(browser, "fault recovered", lambda d: _attr(d, fault, "data-recovered") == "true",
              timeout=RECOVERY_WAIT_S)
        status = api.job(jid)
        record = next(f for f in status["faults"] if f["member_id"] == crashed)
        assert record["recovery_s"] is not None
        text = _text(browser, fault)
        assert f"recovered in {record['recovery_s']:.2f} s" in text
        assert "ReplaceReplica" in text  # the controller's decision is shown with the fault
        fault_id = _attr(browser, fault, "data-fault-id")
        assert fault_id == record["fault_id"]
        assert _count(browser, f'#fault-timeline rect[data-fault-id="{fault_id}"][data-kind="recovered"]') == 1
        _wait(browser, "recovered event", lambda d: _count(d, '#events li[data-kind="recovered"]') >= 1)
        _wait(browser, "replacement member shown",
              lambda d: _attr(d, '#members li[data-member-id="rollout-0-i1"]', "data-state") is not None)

        # The reward curve has a point per committed step, drawn as one line.
        wait_step(api, jid, 3)
        _wait(browser, "reward points", lambda d: int(_attr(d, "#reward-curve", "data-points") or 0) >= 3)
        assert _count(browser, "#reward-curve polyline") == 1
        assert _attr(browser, "#conn-status", "data-state") == "ok"
        # No script error at any point (a syntax error would leave the page blank but "passing").
        errors = [e for e in browser.get_log("browser") if e.get("source") == "javascript"]
        assert errors == []
    finally:
        api.stop(jid)

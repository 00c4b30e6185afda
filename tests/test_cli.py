"""The ``robustrl`` command: up, submit, status, chaos-scenario validation, down."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest
import yaml
from support import eventually

from robustrl.client import ApiClient
from robustrl.ports import free_port

pytestmark = pytest.mark.timeout(240)


def _robustrl(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "robustrl.cli", *args], capture_output=True, text=True,
                          timeout=120, check=check)


def _api(state: dict) -> ApiClient:
    """The API of the stack ``robustrl up`` wrote ``state`` (stack.json) for, as the CLI reaches it."""
    return ApiClient(str(state["api_url"]), str(state["token"]))


def test_up_submit_status_down(tmp_path):
    run_dir = tmp_path / "run"
    spec = tmp_path / "job.yaml"
    spec.write_text(yaml.safe_dump({"name": "cli", "steps": 2, "data": {"prompts_per_step": 2, "group_size": 4}}))
    up = _robustrl("up", "--run-dir", str(run_dir), "--api-port", str(free_port()))
    try:
        assert "RobustRL is up" in up.stdout
        state = json.loads((run_dir / "stack.json").read_text())
        assert oct((run_dir / "stack.json").stat().st_mode & 0o777) == "0o600"
        sub = _robustrl("submit", str(spec), "--run-dir", str(run_dir), "--json")
        job_id = json.loads(sub.stdout)["job_id"]
        # Waited for through the API the CLI talks to (a CLI process a second, each a Python start
        # of about 0.9 s of CPU, was a load of its own on a busy machine); the CLI reads it after.
        _api(state).wait(job_id, lambda j: j["status"] == "finished", timeout_s=150, interval_s=0.5)
        [job] = json.loads(_robustrl("status", job_id, "--run-dir", str(run_dir), "--json").stdout)
        assert job["status"] == "finished" and job["committed_step"] == 1, job
        table = _robustrl("status", "--run-dir", str(run_dir)).stdout
        assert job_id in table and "finished" in table
        bad = tmp_path / "bad.yaml"
        bad.write_text(yaml.safe_dump({"steps": -1}))
        rejected = _robustrl("submit", str(bad), "--run-dir", str(run_dir), check=False)
        assert rejected.returncode == 2 and "steps" in rejected.stdout
        # Deleted: its Redis keys counted in the answer, and the job is gone for status and delete.
        deleted = json.loads(_robustrl("delete", job_id, "--run-dir", str(run_dir), "--json").stdout)
        assert deleted["job_id"] == job_id and deleted["redis_keys_deleted"] > 0 and deleted["checkpoints_kept"]
        gone = _robustrl("status", job_id, "--run-dir", str(run_dir), check=False)
        assert gone.returncode != 0 and "404" in gone.stdout
        again = _robustrl("delete", job_id, "--run-dir", str(run_dir), check=False)
        assert again.returncode != 0 and "404" in again.stdout
    finally:
        down = _robustrl("down", "--run-dir", str(run_dir))
    assert "controller" in down.stdout and "infra" in down.stdout
    for pid in state["pids"].values():
        eventually(lambda pid=pid: not _alive(pid), timeout=15, what=f"pid {pid} stopped")


def test_down_kills_the_members_a_frozen_controller_left(tmp_path):
    """``robustrl down`` with the controller frozen mid-job (it cannot stop its members): every
    member process the stack's launcher started is gone afterwards, checked from /proc by the
    launch mark each one carries, not from anything the stack recorded."""
    import psutil

    from robustrl.launcher.local import LAUNCH_MARK_ENV

    run_dir = tmp_path / "run"
    spec = tmp_path / "job.yaml"
    spec.write_text(yaml.safe_dump({"name": "orphans", "steps": 500, "data": {"prompts_per_step": 2, "group_size": 2}}))
    up = _robustrl("up", "--run-dir", str(run_dir), "--api-port", str(free_port()))
    logs = os.path.realpath(run_dir / "logs") + os.sep

    def members() -> list[int]:
        found = []
        for proc in psutil.process_iter():
            try:
                mark = proc.environ().get(LAUNCH_MARK_ENV, "")
            except (psutil.Error, ProcessLookupError):  # gone meanwhile (psutil lets ESRCH through)
                continue
            if mark and os.path.realpath(mark).startswith(logs) and _alive(proc.pid):
                found.append(proc.pid)
        return found

    try:
        assert "RobustRL is up" in up.stdout
        state = json.loads((run_dir / "stack.json").read_text())
        job_id = json.loads(_robustrl("submit", str(spec), "--run-dir", str(run_dir), "--json").stdout)["job_id"]
        _api(state).wait(job_id, lambda j: j["committed_step"] >= 0, timeout_s=150, interval_s=0.5)
        running = members()
        assert len(running) >= 3, running  # 2 trainer ranks and the replicas at least
        os.kill(state["pids"]["controller"], signal.SIGSTOP)
    finally:
        down = _robustrl("down", "--run-dir", str(run_dir))
    left = members()
    assert not left, (left, down.stdout)
    # Nor the detached supervisor (seen left running after such a down, in a full run).
    assert not _alive(state["supervisor_pid"]), down.stdout


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split()[2] != "Z"


def test_chaos_run_rejects_a_malformed_scenario(tmp_path):
    scenario = tmp_path / "bad.yaml"
    scenario.write_text(yaml.safe_dump({"name": "bad", "faults": [{"kind": "meteor", "role": "trainer"}]}))
    res = _robustrl("chaos", "run", str(scenario), "--out", str(tmp_path / "out"), check=False)
    assert res.returncode == 2 and "kind" in res.stdout


def test_status_without_a_stack_says_what_to_do(tmp_path):
    res = _robustrl("status", "--run-dir", str(tmp_path / "none"), check=False)
    assert res.returncode == 2 and "robustrl up" in res.stdout


@pytest.mark.parametrize("content", ["{not json", "[1, 2]", '{"api_url": 5}', '{"pids": {"controller": "x"}, '
                                     '"supervisor_pid": -1, "starts": 7}'])
def test_a_damaged_stack_file_is_a_clear_error_and_down_still_runs(tmp_path, content):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "stack.json").write_text(content)
    status = _robustrl("status", "--run-dir", str(run_dir), check=False)
    assert status.returncode == 2 and "damaged" in status.stdout and "Traceback" not in status.stderr
    down = _robustrl("down", "--run-dir", str(run_dir), check=False)
    assert down.returncode == 0 and "Traceback" not in down.stderr, down.stderr
    assert not (run_dir / "stack.json").exists()


@pytest.mark.parametrize("job_id", ["../jobs/y", "x?checkpoints=true", "a/b", "", "x" * 65])
def test_a_job_id_that_would_name_another_url_is_refused_before_any_request(job_id):
    from robustrl.client import ApiClient
    from robustrl.errors import JobError

    api = ApiClient("http://127.0.0.1:9", "token")  # nothing listens: no request may be made
    try:
        for call in (api.job, api.events, api.report, api.stop, api.delete):
            with pytest.raises(JobError) as err:
                call(job_id)
            assert err.value.field == "job_id"
    finally:
        api.close()


def test_chaos_run_json_prints_only_the_report_on_stdout(tmp_path):
    scenario = tmp_path / "one-crash.yaml"
    scenario.write_text(yaml.safe_dump({
        "name": "cli-json", "seed": 2,
        "job": {"steps": 4, "data": {"prompts_per_step": 2, "group_size": 4}, "tools": {"latency_s": 0.1}},
        "faults": [{"kind": "crash", "role": "rollout", "member": 0, "at_step": 1, "within_step": 0.2}]}))
    res = subprocess.run([sys.executable, "-m", "robustrl.cli", "chaos", "run", str(scenario), "--out",
                          str(tmp_path / "out"), "--json"], capture_output=True, text=True, timeout=200, check=False)
    assert res.returncode == 0, res.stderr[-3000:]
    report = json.loads(res.stdout)  # nothing but the report: scripts can pipe it
    assert report["status"] == "finished" and report["steps_completed"] == 4
    assert [f["role"] for f in report["faults"]] == ["rollout"]
    assert "report" in res.stderr and "ETTR" in res.stderr  # the human summary went to stderr
    assert json.loads((tmp_path / "out" / "report.json").read_text())["status"] == "finished"


def test_a_stop_slower_than_a_plain_request_is_waited_for_and_a_late_answer_is_not_called_unreachable():
    """A real HTTP server on loopback answering each request only after 1.5 s, with the client's
    plain timeout at 0.5 s: a stop (which the controller answers once carried out: 10 s and more
    on a busy machine) gets its answer; a plain request past its timeout is reported as not
    answered in time, not as a controller that is unreachable or down."""
    import http.server
    import threading

    from robustrl import client
    from robustrl.errors import RequestTimeout

    class Slow(http.server.BaseHTTPRequestHandler):
        def _answer(self) -> None:
            threading.Event().wait(1.5)  # the server's own slowness (what is tested)
            body = json.dumps({"job_id": "j", "status": "stopped"}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        do_GET = do_POST = do_DELETE = _answer

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Slow)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    api = client.ApiClient(f"http://127.0.0.1:{server.server_address[1]}", "token", timeout=0.5)
    try:
        assert api.stop("j")["status"] == "stopped"
        assert api.delete("j")["job_id"] == "j"
        with pytest.raises(RequestTimeout) as err:
            api.job("j")
        assert "did not answer GET /v1/jobs/j within 0.5s" in str(err.value), err.value
        assert "unreachable" not in str(err.value)
    finally:
        api.close()
        server.shutdown()
        server.server_close()

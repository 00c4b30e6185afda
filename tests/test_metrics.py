"""The job metrics (``prometheus_client`` collectors): every line parses, values match the job
dicts, labels are escaped."""

from __future__ import annotations

import math
import re

import pytest

from robustrl.metrics import CONTENT_TYPE, controller_registry, render_prometheus

_NAME = r"[a-zA-Z_:][a-zA-Z0-9_:]*"
_LABEL = r'[a-zA-Z_][a-zA-Z0-9_]*="(?:[^"\\\n]|\\\\|\\"|\\n)*"'
_VALUE = r"(?:[+-]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][+-]?\d+)?|NaN|[+-]Inf)"
_SAMPLE = re.compile(rf"^({_NAME})(\{{(?:{_LABEL}(?:,{_LABEL})*)?\}})? ({_VALUE})$")
_LABEL_PAIR = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


def _unescape(value: str) -> str:
    return re.sub(r"\\(.)", lambda m: {"n": "\n", "\\": "\\", '"': '"'}[m.group(1)], value)


def parse(text: str) -> tuple[dict[str, str], list[tuple[str, dict[str, str], float]]]:
    """A strict parser of the text format: fails the test on any malformed line."""
    assert text.endswith("\n")
    types: dict[str, str] = {}
    samples: list[tuple[str, dict[str, str], float]] = []
    for line in text.splitlines():
        if line.startswith("# HELP "):
            assert re.match(rf"^# HELP {_NAME} .+$", line), line
            continue
        if line.startswith("# TYPE "):
            match = re.match(rf"^# TYPE ({_NAME}) (gauge|counter|histogram|summary|untyped)$", line)
            assert match, line
            assert match.group(1) not in types, f"duplicate TYPE {line}"
            types[match.group(1)] = match.group(2)
            continue
        match = _SAMPLE.match(line)
        assert match, f"bad sample line: {line!r}"
        name, labels_raw, value = match.groups()
        family = re.sub(r"_(bucket|sum|count)$", "", name)
        assert name in types or family in types, f"sample before its TYPE: {line}"
        labels = {k: _unescape(v) for k, v in _LABEL_PAIR.findall(labels_raw or "")}
        samples.append((name, labels, float(value.replace("Inf", "inf"))))
    return types, samples


def pick(samples: list[tuple[str, dict[str, str], float]], metric: str, /, **labels: str) -> list[float]:
    return [v for n, lab, v in samples if n == metric and all(lab.get(k) == x for k, x in labels.items())]


def _job(**overrides: object) -> dict[str, object]:
    job: dict[str, object] = {
        "job_id": "j1", "name": "reference", "status": "running", "policy": "role_local",
        "step": 7, "steps_total": 30, "weights_version": 7, "reward_by_step": [0.1, 0.2, 0.25],
        "members": [
            {"member_id": "trainer-0", "role": "trainer", "state": "running", "phase": "training",
             "weights_version": 7},
            {"member_id": "trainer-1", "role": "trainer", "state": "running", "phase": "training",
             "weights_version": 7},
            {"member_id": "rollout-0", "role": "rollout", "state": "running", "phase": "serving",
             "weights_version": 6},
            {"member_id": "rollout-1", "role": "rollout", "state": "exited", "phase": "starting",
             "weights_version": None},
        ],
        "faults": [
            {"fault_id": "f1", "kind": "crash", "role": "rollout", "member_id": "rollout-1", "step": 3,
             "detection_s": 0.8, "recovery_s": 4.0},
            {"fault_id": "f2", "kind": "hang", "role": "trainer", "member_id": "trainer-0", "step": 5,
             "detection_s": 4.5, "recovery_s": 12.0},
            {"fault_id": "f3", "kind": "crash", "role": "rollout", "member_id": "rollout-0", "step": 7,
             "detection_s": 1.5, "recovery_s": None},
        ],
        "ettr": 0.87,
        "last_step_timings": {"generation_s": 1.25, "tool_wait_s": 0.5, "training_s": 0.1,
                              "checkpoint_blocking_s": 0.02, "upload_s": 0.3, "weight_sync_s": 0.04},
    }
    job.update(overrides)
    return job


def test_values_match_job_dicts() -> None:
    jobs = [_job(), _job(job_id="j2", status="finished", faults=[], ettr=None, reward_by_step=[])]
    types, samples = parse(render_prometheus(jobs))
    assert types["robustrl_jobs"] == "gauge"
    assert types["robustrl_faults_total"] == "counter"
    assert types["robustrl_fault_detection_seconds"] == "histogram"
    assert pick(samples, "robustrl_jobs", status="running") == [1]
    assert pick(samples, "robustrl_jobs", status="finished") == [1]
    assert pick(samples, "robustrl_jobs", status="recovering") == [0]  # every status always present
    assert pick(samples, "robustrl_job_step", job_id="j1") == [7]
    assert pick(samples, "robustrl_job_steps_planned", job_id="j1") == [30]
    assert pick(samples, "robustrl_job_reward_last", job_id="j1") == [0.25]
    assert pick(samples, "robustrl_job_reward_last", job_id="j2") == []  # no steps yet: no sample
    assert pick(samples, "robustrl_job_ettr", job_id="j1") == [0.87]
    assert pick(samples, "robustrl_job_ettr", job_id="j2") == []
    assert pick(samples, "robustrl_members", job_id="j1", role="trainer", state="running") == [2]
    assert pick(samples, "robustrl_members", job_id="j1", role="rollout", state="exited") == [1]
    assert pick(samples, "robustrl_member_weights_version", member_id="rollout-0") == [6, 6]
    assert pick(samples, "robustrl_member_weights_version", job_id="j1", member_id="rollout-1") == []
    assert pick(samples, "robustrl_faults_total", job_id="j1", kind="crash", role="rollout") == [2]
    assert pick(samples, "robustrl_faults_total", job_id="j1", kind="hang", role="trainer") == [1]
    assert pick(samples, "robustrl_last_step_seconds", job_id="j1", part="weight_sync") == [0.04]
    assert pick(samples, "robustrl_last_step_seconds", job_id="j1", part="checkpoint_blocking") == [0.02]
    assert pick(samples, "robustrl_job_info", job_id="j1", policy="role_local", status="running") == [1]


def test_controller_fields_committed_durable_restarts() -> None:
    # The controller's ``step`` is the step in progress; the gauge reports the committed one.
    job = _job(step=8, committed_step=7, durable_step=6, restarts_total=2)
    types, samples = parse(render_prometheus([job, _job(job_id="j0", step=0, committed_step=-1)]))
    assert pick(samples, "robustrl_job_step", job_id="j1") == [7]
    assert pick(samples, "robustrl_job_step", job_id="j0") == [-1]
    assert pick(samples, "robustrl_job_durable_step", job_id="j1") == [6]
    assert types["robustrl_job_restarts_total"] == "counter"
    assert pick(samples, "robustrl_job_restarts_total", job_id="j1") == [2]
    assert pick(samples, "robustrl_job_restarts_total", job_id="j0") == []


def test_histograms_are_cumulative_and_consistent() -> None:
    _, samples = parse(render_prometheus([_job()]))
    buckets = [(lab["le"], v) for n, lab, v in samples
               if n == "robustrl_fault_detection_seconds_bucket" and lab["job_id"] == "j1"]
    counts = [v for _, v in buckets]
    assert counts == sorted(counts), "buckets must be cumulative"
    assert buckets[-1] == ("+Inf", 3)
    assert dict(buckets)["1.0"] == 1 and dict(buckets)["2.0"] == 2 and dict(buckets)["5.0"] == 3
    assert pick(samples, "robustrl_fault_detection_seconds_count", job_id="j1") == [3]
    assert pick(samples, "robustrl_fault_detection_seconds_sum", job_id="j1") == [pytest.approx(6.8)]
    # The unrecovered fault (recovery_s None) is counted as a fault but not observed as a recovery.
    assert pick(samples, "robustrl_fault_recovery_seconds_count", job_id="j1") == [2]
    assert pick(samples, "robustrl_fault_recovery_seconds_sum", job_id="j1") == [16]


def test_label_values_are_escaped() -> None:
    nasty = 'we"ird\\name\nline2'
    text = render_prometheus([_job(job_id='j"1', name=nasty)])
    _, samples = parse(text)
    info = [lab for n, lab, _ in samples if n == "robustrl_job_info"]
    assert info == [{"job_id": 'j"1', "name": nasty, "policy": "role_local", "status": "running"}]


def test_partial_and_bad_input_never_fails_the_scrape() -> None:
    jobs = [
        {"job_id": "bare"},
        {"name": "no-id"},  # skipped: cannot be labelled
        {"job_id": "odd", "status": "running", "step": "seven", "ettr": True, "members": "x",
         "faults": [None, {"kind": "crash"}], "last_step_timings": {"weight_sync_s": "fast"},
         "reward_by_step": [None]},
    ]
    _, samples = parse(render_prometheus(jobs))
    assert pick(samples, "robustrl_jobs", status="unknown") == [1]
    assert pick(samples, "robustrl_job_step", job_id="odd") == []
    assert pick(samples, "robustrl_job_ettr", job_id="odd") == []
    assert pick(samples, "robustrl_faults_total", job_id="odd", kind="crash", role="unknown") == [1]
    assert pick(samples, "robustrl_last_step_seconds", job_id="odd") == []
    _, empty = parse(render_prometheus([]))
    assert sum(v for n, _, v in empty if n == "robustrl_jobs") == 0


def test_value_formatting() -> None:
    _, samples = parse(render_prometheus([_job(ettr=math.nan, steps_total=30, reward_by_step=[0.25])]))
    assert pick(samples, "robustrl_job_steps_planned", job_id="j1") == [30]
    assert [math.isnan(v) for v in pick(samples, "robustrl_job_ettr", job_id="j1")] == [True]
    assert "version=0.0.4" in CONTENT_TYPE


def test_the_controller_registry_adds_its_own_process_metrics() -> None:
    from prometheus_client import generate_latest

    jobs = [_job()]
    registry = controller_registry(lambda: jobs)
    _, samples = parse(generate_latest(registry).decode())
    assert pick(samples, "robustrl_job_step", job_id="j1") == [7]
    assert pick(samples, "process_resident_memory_bytes") and pick(samples, "process_open_fds")
    jobs.append(_job(job_id="j2"))  # read at each scrape, not once
    _, later = parse(generate_latest(registry).decode())
    assert pick(later, "robustrl_job_step", job_id="j2") == [7]


def test_prometheus_client_parser_agrees() -> None:
    """Cross-check with the reference parser when prometheus_client is installed."""
    parser = pytest.importorskip("prometheus_client.parser")
    families = {f.name: f for f in parser.text_string_to_metric_families(render_prometheus([_job()]))}
    assert families["robustrl_faults"].type == "counter"
    detection = families["robustrl_fault_detection_seconds"]
    assert detection.type == "histogram"
    count = [s.value for s in detection.samples if s.name.endswith("_count")]
    assert count == [3]

"""Schema-driven fuzzing of the controller's REST API with schemathesis: ``fuzz_rest`` sends N
generated requests (positive and negative data for every operation in ``/openapi.json``, with
the bearer token) and runs schemathesis's conformance checks on each answer.

Pass means: every request answered, no 5xx, and every answer conforms to the OpenAPI document (its status code is
declared for the operation, its content type is the declared one, its body validates against the
declared schema, declared headers are present) and negative data is refused with a 4xx. Used by
``tests/test_api_fuzz.py`` (small, seeded) and by ``bench/fuzz.py`` (>= 5,000 requests).

Not checked: ``positive_data_acceptance`` -- the job spec has cross-field rules JSON Schema cannot
state (staleness per mode, heads dividing the width, step deadline covering its parts), so a
schema-valid spec may rightly get 422.
"""

from __future__ import annotations

import logging
import random
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import requests
import schemathesis
from hypothesis import HealthCheck, Phase, given, seed, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.core.failures import Failure, FailureGroup
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    ignored_auth,
    negative_data_rejection,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
    unsupported_method,
)

CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_headers_conformance,
          response_schema_conformance, negative_data_rejection, ignored_auth, unsupported_method]
"""``ignored_auth`` re-sends the request without and with a wrong token (must be 401);
``unsupported_method`` sends it with a method the path does not declare (must be 405 with Allow)."""
REQUEST_TIMEOUT_S = 30.0
EXAMPLES_PER_ROUND = 25
"""Examples per (operation, mode) in one round; rounds repeat with new seeds until N requests."""
MAX_FAILURES_KEPT = 20
PROGRESS_EVERY = 250
log = logging.getLogger("rest_fuzz")


@dataclass
class RestFuzzResult:
    requests: int = 0
    by_status: dict[str, int] = field(default_factory=dict)
    server_errors: int = 0
    no_answer: int = 0
    """Requests that got no answer within REQUEST_TIMEOUT_S (or a dropped connection)."""
    schema_violations: int = 0
    violations_by_check: dict[str, int] = field(default_factory=dict)
    by_operation: dict[str, int] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)
    seconds: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _check_names(exc: BaseException) -> list[str]:
    """Names of the failed checks in what ``Case.validate_response`` raised."""
    inner = getattr(exc, "exceptions", None) or [exc]
    names = []
    for failure in inner:
        title = getattr(failure, "title", None) or type(failure).__name__
        names.append(str(title))
    return names


class _Fuzzer:
    def __init__(self, base_url: str, token: str, seed_value: int, job_ids: list[str]) -> None:
        self.base_url = base_url
        self.auth = {"Authorization": f"Bearer {token}"}
        self.job_ids = job_ids
        self.chooser = random.Random(seed_value)
        self.session = requests.Session()
        self.result = RestFuzzResult()
        self.statuses: Counter[str] = Counter()
        self.checks: Counter[str] = Counter()
        self.operations: Counter[str] = Counter()

    def run(self, operation: Any, mode: GenerationMode, budget: int, seed_value: int) -> None:
        """Send up to ``budget`` cases of ``operation``; raises Unsatisfiable if it has none."""
        sent = 0

        @seed(seed_value)
        @settings(max_examples=budget, database=None, deadline=None, phases=[Phase.generate],
                  suppress_health_check=list(HealthCheck))
        @given(case=operation.as_strategy(generation_mode=mode, headers=self.auth))
        def run(case: Any) -> None:
            nonlocal sent
            if sent < budget:
                sent += 1
                self.send(operation.label, mode, case)

        run()

    def send(self, label: str, mode: GenerationMode, case: Any) -> None:
        if self.job_ids and "job_id" in (case.path_parameters or {}) and self.chooser.random() < 0.5:
            case.path_parameters["job_id"] = self.chooser.choice(self.job_ids)
        result = self.result
        result.requests += 1
        if result.requests % PROGRESS_EVERY == 0:
            log.info("rest fuzz: %d requests, %d server errors, %d schema violations", result.requests,
                     result.server_errors, result.schema_violations)
        try:
            response = case.call(base_url=self.base_url, session=self.session, headers=self.auth,
                                 timeout=REQUEST_TIMEOUT_S)
        except requests.RequestException as exc:
            result.no_answer += 1
            self.statuses["no answer"] += 1
            if len(result.failures) < MAX_FAILURES_KEPT:
                result.failures.append(f"{label} [{mode.value}] -> no answer: {str(exc)[:500]}")
            return
        self.statuses[str(response.status_code)] += 1
        self.operations[label] += 1
        if response.status_code >= 500:
            result.server_errors += 1
        try:
            case.validate_response(response, checks=CHECKS, headers=self.auth,
                                   transport_kwargs={"base_url": self.base_url, "headers": self.auth,
                                                     "timeout": REQUEST_TIMEOUT_S})
        except (FailureGroup, Failure, AssertionError) as exc:
            names = [n for n in _check_names(exc) if n != "Server error"]
            if names:
                result.schema_violations += 1
                self.checks.update(names)
            if len(result.failures) < MAX_FAILURES_KEPT:
                result.failures.append(f"{label} [{mode.value}] -> {response.status_code}: {str(exc)[:1500]}")

    def finish(self, started: float) -> RestFuzzResult:
        self.session.close()
        result = self.result
        result.by_status = dict(sorted(self.statuses.items()))
        result.violations_by_check = dict(self.checks)
        result.by_operation = dict(self.operations)
        result.seconds = round(time.monotonic() - started, 1)
        return result


def fuzz_rest(base_url: str, token: str, *, requests_total: int = 300, seed_value: int = 0,
              job_ids: list[str] | None = None) -> RestFuzzResult:
    """Send about ``requests_total`` generated requests to the API at ``base_url``.

    Args:
        base_url: where the controller's API listens, e.g. ``http://127.0.0.1:8321``.
        token: the API's bearer token (sent on every request).
        requests_total: how many generated requests to send (each operation gets its share).
        seed_value: fixes the generated data (same seed, same requests).
        job_ids: ids of existing jobs; half of the requests to ``/v1/jobs/{job_id}/...`` use one
            of them instead of a generated id, so the fault and stop paths are reached.

    Returns:
        counts of requests, answers by status, 5xx answers and answers that violate the schema
        (``schema_violations``, by check in ``violations_by_check``), the first failures verbatim.
    """
    started = time.monotonic()
    fuzzer = _Fuzzer(base_url, token, seed_value, list(job_ids or []))
    schema = schemathesis.openapi.from_url(f"{base_url}/openapi.json", headers=fuzzer.auth,
                                           timeout=REQUEST_TIMEOUT_S)
    operations = [result.ok() for result in schema.get_all_operations()]
    share = -(-requests_total // (2 * len(operations)))
    impossible: set[tuple[str, GenerationMode]] = set()  # e.g. negative data for an operation without inputs
    round_no = 0
    while fuzzer.result.requests < requests_total and len(impossible) < 2 * len(operations):
        for operation in operations:
            for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
                left = requests_total - fuzzer.result.requests
                if left <= 0 or (operation.label, mode) in impossible:
                    continue
                try:
                    fuzzer.run(operation, mode, min(EXAMPLES_PER_ROUND, left, share),
                               seed_value * 1_000_003 + round_no)
                except Unsatisfiable:
                    impossible.add((operation.label, mode))
        round_no += 1
    return fuzzer.finish(started)


def fuzz_controller(run_dir: Path, *, requests_total: int, seed_value: int = 0, jobs: int = 2) -> RestFuzzResult:
    """``fuzz_rest`` against a controller of its own (``rest_target.serve_controller``): real API,
    controller, event log and registry on private servers; a ledger launcher instead of members."""
    from rest_target import serve_controller

    with serve_controller(run_dir) as target:
        spec = {"steps": 3, "rollout": {"replicas": 2}, "trainer": {"workers": 2}}
        job_ids = []
        for i in range(jobs):
            resp = requests.post(f"{target.base_url}/v1/jobs", json={**spec, "name": f"fuzzed{i}"},
                                 headers=target.headers, timeout=REQUEST_TIMEOUT_S)
            resp.raise_for_status()
            job_ids.append(resp.json()["job_id"])
        return fuzz_rest(target.base_url, target.token, requests_total=requests_total, seed_value=seed_value,
                         job_ids=job_ids)


def merge(results: list[RestFuzzResult]) -> RestFuzzResult:
    """One result from several runs (e.g. parallel workers with different seeds)."""
    total = RestFuzzResult()
    counters: dict[str, Counter[str]] = {"by_status": Counter(), "violations_by_check": Counter(),
                                         "by_operation": Counter()}
    for r in results:
        total.requests += r.requests
        total.server_errors += r.server_errors
        total.no_answer += r.no_answer
        total.schema_violations += r.schema_violations
        total.failures.extend(r.failures[:MAX_FAILURES_KEPT - len(total.failures)])
        total.seconds = max(total.seconds, r.seconds)
        for name, counter in counters.items():
            counter.update(getattr(r, name))
    total.by_status = dict(sorted(counters["by_status"].items()))
    total.violations_by_check = dict(counters["violations_by_check"])
    total.by_operation = dict(counters["by_operation"])
    return total


def _worker(args: tuple[str, int, int]) -> RestFuzzResult:
    run_dir, requests_total, seed_value = args
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(message)s")
    log.setLevel(logging.INFO)
    return fuzz_controller(Path(run_dir), requests_total=requests_total, seed_value=seed_value)


def main() -> None:
    """``python tests/rest_fuzz.py --requests 5000 [--workers 4] --out FILE``: one full-size run
    (workers: separate processes, each with its own controller and seed; results summed)."""
    import argparse
    import json
    import multiprocessing
    import tempfile

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=5000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="rest-fuzz-") as tmp:
        shares = [args.requests // args.workers + (i < args.requests % args.workers) for i in range(args.workers)]
        jobs = [(f"{tmp}/w{i}", share, args.seed * 100 + i) for i, share in enumerate(shares)]
        if args.workers == 1:
            results = [_worker(jobs[0])]
        else:
            with multiprocessing.get_context("spawn").Pool(args.workers) as pool:
                results = pool.map(_worker, jobs)
    result = merge(results).to_dict()
    result["workers"] = args.workers
    text = json.dumps(result, indent=2)
    if args.out:
        args.out.write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()

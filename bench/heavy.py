"""The heavy end-to-end checks: tests marked ``heavy``, outside the default suite.

    python bench/heavy.py --out bench/results/heavy.json

The default suite (``scripts/test.sh``) must stay under 30 minutes on 2 cores, so the runs that
take minutes each and repeat what other tests already cover in part run here instead, by this one
command, on real servers like every test:

* ``tests/test_vllm_engine.py``: a trainer rank borrowed from a **vLLM** rollout pool, switched in
  place, and the pool restocked with vLLM replicas (~160 s: four vLLM engine starts). The suite
  keeps the vLLM engine test itself, and borrowing with the local, Docker and Ray launchers.
* ``tests/test_ray_testbed.py``: a Ray cluster whose worker nodes are network namespaces, a
  worker host's link cut, then a node lost with a warm spare on the other (~120 s). The suite keeps
  the Ray launcher's actor kill, node loss, controller restart and standby (test_ray_launcher).
* ``tests/test_vllm_engine.py``, the engine test with ``rollout.vllm_cpu_linear: plain`` (~100 s
  of vLLM). The suite keeps the same test with the default layout (packed).
* ``tests/test_docker_spares.py`` and ``tests/test_docker_standby.py``: the two jobs on the Docker
  launcher, every member a container of this commit's code: a crashed trainer replaced from a
  warm spare container (~110-145 s), and trainer ranks borrowed from replica containers switched
  in place (~125-165 s, with its image build). The suite keeps the Docker launcher's parts on a
  real dockerd (a spare container's hand-off, a rollout container switched to a trainer rank in
  place, a container adopted from its labels) and a whole job in Docker containers, the compose
  stack's (test_compose_stack: a trainer container killed, recovered role-locally).
* ``tests/test_rm_recovery.py``: Redis memory flat over a 60-step job (~65-80 s); its 200-step
  measure is ``bench/redis_memory.py``.

The last four were moved out (2026-12-07) when CI's run of the suite took 1768 s of pytest and
1915 s in all, past the 30-minute bound.

Writes each test's outcome and seconds (measured: pytest's own timing, from its JUnit XML) and
exits with pytest's status. Extra arguments after ``--`` go to pytest.
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _outcome(case: ET.Element) -> tuple[str, str | None]:
    for tag in ("failure", "error", "skipped"):
        node = case.find(tag)
        if node is not None:
            outcome = {"failure": "failed", "error": "error", "skipped": "skipped"}[tag]
            return outcome, (node.get("message") or "")[:2000]
    return "passed", None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True, help="JSON report path")
    ap.add_argument("pytest_args", nargs="*", help="more pytest arguments (after --)")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="rrl-heavy-") as tmp:
        xml_path = Path(tmp) / "junit.xml"
        t0 = time.time()
        rc = subprocess.call([sys.executable, "-m", "pytest", "-q", "-ra", "-p", "no:cacheprovider",
                              "-m", "heavy", f"--junitxml={xml_path}", *args.pytest_args], cwd=ROOT)
        wall = time.time() - t0
        tests = []
        if xml_path.exists():
            for case in ET.parse(xml_path).getroot().iter("testcase"):
                outcome, message = _outcome(case)
                tests.append({"test": f"{case.get('classname')}::{case.get('name')}", "outcome": outcome,
                              "seconds": round(float(case.get("time") or 0.0), 1), "message": message})
    report = {"what": "tests marked heavy, run on real servers (measured, nothing modelled)",
              "pytest_exit": rc, "wall_s": round(wall, 1), "machine": platform.node(),
              "passed": sum(t["outcome"] == "passed" for t in tests),
              "failed": sum(t["outcome"] in ("failed", "error") for t in tests),
              "skipped": sum(t["outcome"] == "skipped" for t in tests), "tests": tests}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1))
    print(json.dumps({k: v for k, v in report.items() if k != "tests"}))
    return rc


if __name__ == "__main__":
    sys.exit(main())

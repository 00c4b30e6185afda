#!/usr/bin/env bash
# Second command: set up, then run the whole test suite (real NATS, Redis and S3 servers).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# The vllm test group (tests/test_vllm_engine.py) runs real vLLM from its own environment,
# .venv-vllm (about a minute and 3.5 GB the first time, seconds after); if it cannot be set up
# those tests are skipped with the reason printed.
bash scripts/setup.sh --vllm-only \
  || echo "could not set up .venv-vllm (see .venv-vllm/setup.log): the vllm tests will be skipped"
# Debian packages for two tests; without them each is skipped (with the reason printed):
#   chromium + chromium-driver: the dashboard in a real headless browser;
#   docker.io + debootstrap: the compose stack on a private dockerd (test_compose_stack.py).
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  missing=()
  command -v chromium >/dev/null 2>&1 || missing+=(chromium chromium-driver)
  command -v dockerd >/dev/null 2>&1 || missing+=(docker.io)
  command -v debootstrap >/dev/null 2>&1 || missing+=(debootstrap)
  if [ "${#missing[@]}" -gt 0 ]; then
    # apt's own chatter (debconf notes) goes to a log; it is printed only if the install fails
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}") \
      >.venv/apt.log 2>&1 \
      || { tail -n 20 .venv/apt.log; echo "could not install ${missing[*]}: the tests that need them will be skipped"; }
  fi
fi
. .venv/bin/activate
# Tests marked heavy (multi-minute end-to-end runs) are bench/heavy.py's, not this suite's.
# Two workers (pytest-xdist): most tests wait on processes and servers more than they compute.
# Each module runs whole on one worker; those that use the machine's own resources (dockerd's
# data root, Ray's ports, the testbed's namespaces) run one after another (tests/conftest.py).
# ROBUSTRL_TEST_WORKERS=0 runs the suite in one process.
exec python -m pytest -q -ra --durations=25 -m "not heavy" \
  -n "${ROBUSTRL_TEST_WORKERS:-2}" --dist loadscope --no-loadscope-reorder "$@"

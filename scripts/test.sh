#!/usr/bin/env bash
# Second command: set up, then run the whole test suite (real NATS, Redis and S3 servers).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# The optional parts are set up beside the suite, not before it (about 2.5 minutes on a fresh
# machine): each test that needs one waits for it (tests/support.py: wait_for_setup), and is
# skipped, with the reason printed, if it could not be set up.
#   vllm: the vllm test group (tests/test_vllm_engine.py) runs real vLLM from its own
#         environment, .venv-vllm (about a minute and 3.5 GB the first time, seconds after);
#   apt:  Debian packages for the tests that need them: chromium + chromium-driver (the
#         dashboard in a real headless browser), docker.io + debootstrap (the compose stack and the
#         Docker standby on a private dockerd).
bg=.venv/setup-beside
rm -rf "$bg" && mkdir -p "$bg"
export ROBUSTRL_SETUP_BESIDE="$PWD/$bg"
# Each part's exit status lands in <part>.rc whatever it is (renamed into place: never read half-written).
beside() {
  local part=$1 rc=0
  shift
  nice -n 10 "$@" >"$bg/$part.log" 2>&1 || rc=$?
  echo "$rc" >"$bg/$part.rc.tmp" && mv "$bg/$part.rc.tmp" "$bg/$part.rc"
}
beside vllm bash scripts/setup.sh --vllm-only &
vllm_setup=$!
apt_needed() {
  [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1 || return 1
  missing=()
  command -v chromium >/dev/null 2>&1 || missing+=(chromium chromium-driver)
  command -v dockerd >/dev/null 2>&1 || missing+=(docker.io)
  command -v debootstrap >/dev/null 2>&1 || missing+=(debootstrap)
  [ "${#missing[@]}" -gt 0 ]
}
if apt_needed; then
  # apt's own chatter (debconf notes) goes to the log; the tests print its end if it fails
  beside apt bash -c 'apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$@"' \
    apt "${missing[@]}" &
  apt_setup=$!
else
  echo 0 >"$bg/apt.rc"
  apt_setup=
fi
. .venv/bin/activate
# Tests marked heavy (multi-minute end-to-end runs) are bench/heavy.py's, not this suite's.
# Three workers (pytest-xdist) on two cores: most tests wait on processes and servers more than
# they compute (two workers kept the cores ~65% busy; three: 1407 s against 1933 s for the same tests).
# Each module runs whole on one worker; those that use the machine's own resources (dockerd's
# data root, Ray's ports, the testbed's namespaces) run one after another (tests/conftest.py).
# ROBUSTRL_TEST_WORKERS=0 runs the suite in one process.
# pytest runs as a job of this script's (not exec'd: the setups beside it are waited for below);
# a TERM or an interrupt of the script is passed on to it.
python -m pytest -q -ra --durations=25 -m "not heavy" \
  -n "${ROBUSTRL_TEST_WORKERS:-3}" --dist loadscope --no-loadscope-reorder "$@" &
pytest_pid=$!
trap 'kill -TERM "$pytest_pid" 2>/dev/null || true' TERM INT
rc=0
wait "$pytest_pid" || rc=$?
while kill -0 "$pytest_pid" 2>/dev/null; do  # the wait above ended early, at a signal
  rc=0
  wait "$pytest_pid" || rc=$?
done
trap - TERM INT
# The setups beside it run to their end (a package manager stopped midway leaves dpkg to repair).
wait $vllm_setup $apt_setup 2>/dev/null || true
[ "$(cat "$bg/vllm.rc" 2>/dev/null)" = 0 ] \
  || echo "could not set up .venv-vllm (see .venv-vllm/setup.log): the vllm tests were skipped"
[ "$(cat "$bg/apt.rc" 2>/dev/null)" = 0 ] \
  || { tail -n 20 "$bg/apt.log"; echo "could not install the Debian packages: the tests that need them were skipped"; }
exit "$rc"

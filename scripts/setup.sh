#!/usr/bin/env bash
# Create .venv and install RobustRL with everything the demo and the tests need.
# torch is pinned to the CPU wheel this machine ships (a bare `torch` pulls a multi-GB CUDA build).
# pip's own chatter (build-backend notices, index warnings of the machine's pip config) goes to
# .venv/setup.log; it is printed only when a step fails.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
. .venv/bin/activate
log=.venv/setup.log
: > "$log"
step() {
  if ! "$@" >>"$log" 2>&1; then
    echo "setup failed: $*" >&2
    tail -n 40 "$log" >&2
    exit 1
  fi
}
echo "setting up .venv (details in $log)"
step python -m pip install -q --upgrade pip
step python -m pip install -q "torch==2.13.0"
step python -m pip install -q -e ".[ml,test,ucx,docker,ray]"

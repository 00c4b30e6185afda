#!/usr/bin/env bash
# Create .venv and install RobustRL with everything the demo and the tests need.
# torch is pinned to the CPU wheel this machine ships (a bare `torch` pulls a multi-GB CUDA build).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
. .venv/bin/activate
python -m pip install -q --upgrade pip
python -m pip install -q "torch==2.13.0"
python -m pip install -q -e ".[ml,test,ucx,docker]"

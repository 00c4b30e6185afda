#!/usr/bin/env bash
# First command: set up, then run the reference RL job with injected faults on embedded infra.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
exec robustrl demo --out out/demo "$@"

#!/usr/bin/env bash
# Every benchmark, one after the other (they need the machine to themselves), JSON into bench/results/.
set -euo pipefail
cd "$(dirname "$0")/.."
. .venv/bin/activate
mkdir -p bench/results
python bench/ettr.py --out bench/results/ettr.json
python bench/step_profile.py --out bench/results/step_profile.json
python bench/weight_sync.py --out bench/results/weight_sync.json
python bench/start.py --out bench/results/start.json
python bench/redis_memory.py --out bench/results/redis_memory.json
# the fan-out measured on testbed hosts with shaped links (network namespaces: root only)
if [ "$(id -u)" = 0 ]; then
  python bench/weight_sync.py --testbed --link 200mbit,100mbit --out bench/results/weight_sync_testbed.json
fi
python bench/heavy.py --out bench/results/heavy.json

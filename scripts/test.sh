#!/usr/bin/env bash
# Second command: set up, then run the whole test suite (real NATS, Redis and S3 servers).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# Debian's Chromium drives the dashboard test; without it that one test is skipped (with the reason).
if ! command -v chromium >/dev/null 2>&1 && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver >/dev/null) \
    || echo "chromium could not be installed: the dashboard browser test will be skipped"
fi
. .venv/bin/activate
exec python -m pytest -q -ra "$@"

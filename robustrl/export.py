"""A job's trained policy out of its checkpoints, as a model directory (``robustrl export``).

The checkpoint a job's trainer wrote (the newest complete one, or a chosen step; each blob
verified against its manifest's sha256 on the way) is loaded into the job's own model class and
written with ``save_pretrained``, beside the job's tokenizer: for a Hugging Face job, the source
directory's tokenizer files and chat template (so ``AutoModelForCausalLM`` / ``AutoTokenizer`` and
vLLM load it, and so does ``model.path`` of a later job); for a random-init job, RobustRL's char
tokenizer. ``robustrl-export.json`` in it names the job, the step, the epoch and the weights'
checksum (the one the trainer committed for that step's version).
"""

from __future__ import annotations

import asyncio
import json
import shutil
from pathlib import Path
from typing import Any

from robustrl.config import JobSpec, Settings
from robustrl.errors import ConfigError, StorageError

RECORD = "robustrl-export.json"
_WEIGHT_FILES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".h5", ".msgpack", ".index.json")
"""A source directory's files that are weights (never copied: the export's own are written)."""
_MODEL_FILES = ("config.json",)
"""Written by ``save_pretrained`` itself."""


async def _job_spec(settings: Settings, job_id: str) -> JobSpec:
    from robustrl.storage.control_stores import JobRegistry
    from robustrl.storage.redis_stores import connect

    client = connect(settings.redis_url)
    try:
        record = await JobRegistry(client).get(job_id)
    finally:
        await client.aclose()
    if record is None:
        raise ConfigError(f"no job {job_id!r} in the job registry", field="job_id")
    return JobSpec.parse(record["spec"], saved=True)


def export_model(settings: Settings, job_id: str, out: str | Path, step: int | None = None) -> dict[str, Any]:
    """Write job ``job_id``'s policy at ``step`` (default: its newest complete checkpoint) to the
    new directory ``out``; return what ``robustrl-export.json`` says.

    Raises:
        ConfigError: ``out`` exists and is not empty (field ``out``: nothing is overwritten); no
            such job (``job_id``); the job has no checkpoint, or none of ``step`` (``step``: the
            steps it has are named); the job's model directory is gone (``model.path``).
        CheckpointError: the checkpoint does not verify (a blob's sha256, a missing part).
        StorageError / TransportError: the object store or Redis failed.
    """
    import torch

    from robustrl.checkpoint import Checkpointer
    from robustrl.checkpoint_catalog import loadable
    from robustrl.model.hf import ChatTokenizer, load_tokenizer
    from robustrl.model.policy import build_policy, weights_checksum
    from robustrl.services.trainer.worker import checkpoint_prefix
    from robustrl.storage.objects import open_object_store

    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConfigError(f"{out} exists and is not an empty directory: nothing is overwritten", field="out")
    spec = asyncio.run(_job_spec(settings, job_id))
    store = open_object_store(settings)
    prefix = checkpoint_prefix(job_id)
    ckpt = Checkpointer(store, prefix)
    if step is None:
        state = ckpt.load_latest()
        if state is None:
            raise ConfigError(f"job {job_id} has no complete checkpoint", field="step")
    else:
        steps = sorted({r.step for r in loadable(store, prefix)})
        if step not in steps:
            raise ConfigError(f"job {job_id} has no checkpoint of step {step} (it has: "
                              f"{', '.join(map(str, steps)) or 'none'})", field="step")
        state = ckpt.load(step)
    tok = load_tokenizer(spec.model)
    model = build_policy(spec.model, tok, spec.seed)
    missing, unexpected = model.load_state_dict(state.model_state, strict=False)
    if missing or unexpected:
        raise StorageError(f"checkpoint {state.step} of job {job_id} does not fit the job's model: "
                           f"missing {sorted(missing)[:5]}, unexpected {sorted(unexpected)[:5]}", key=prefix)
    checksum = weights_checksum(model)
    out.mkdir(parents=True, exist_ok=True)
    if isinstance(tok, ChatTokenizer):
        source = Path(str(spec.model.path))
        for item in source.iterdir():
            if item.is_file() and item.name not in _MODEL_FILES and not item.name.endswith(_WEIGHT_FILES):
                shutil.copy2(item, out / item.name)
    else:
        tok.save(out)
    with torch.no_grad():
        model.save_pretrained(str(out))
    record = {"job_id": job_id, "step": state.step, "epoch": state.epoch, "weights_version": state.weights_version,
              "weights_checksum": checksum, "model": spec.model.model_dump(mode="json")}
    (out / RECORD).write_text(json.dumps(record, indent=1))
    return record

"""Checkpoint invariants of the auditor that an outside review found missing: each test builds,
with the trainer's real ``Checkpointer`` writing into a real object store (files), a state the
earlier auditor passed and the auditor must now fail.

"Loadable" now covers rank coverage (a ``state.pt`` of every rank of the gang), blobs inside
their own rank's folder of the manifest's own step and gang, and the chain of gang origins; the
newest fully loadable step is reported and no ``durable_step`` may lie beyond it; and the model in
each checkpoint, hashed again from its blobs, must be what was published for its version.
"""

from __future__ import annotations

import hashlib
import io
import json
from pathlib import Path
from typing import Any

import torch
from test_audit import Log

from robustrl.audit import AuditInput, AuditOptions, judge
from robustrl.audit.raw import RawEvent, RawRedis, scan_checkpoints, scan_origins
from robustrl.checkpoint import Checkpointer, CheckpointState, capture_rng
from robustrl.checkpoint_reader import REF
from robustrl.model.policy import weights_checksum
from robustrl.storage.objects import FileObjectStore, ObjectStore

torch.set_num_threads(1)
WORKERS = 2


def _violations(report: Any) -> str:
    return "\n".join(report.violations())


def _prefix(job: str) -> str:
    return f"jobs/{job}/checkpoints"


class Gang:
    """A real two-rank gang writing checkpoints with the trainer's ``Checkpointer``, and the events
    a trainer gang logs for what it does."""

    def __init__(self, store: ObjectStore, job: str, log: Log, epoch: int, model: torch.nn.Module,
                 opt: torch.optim.Optimizer, resume: CheckpointState | None) -> None:
        self.ranks = [Checkpointer(store, _prefix(job), keep=1000, rank=r, world_size=WORKERS, epoch=epoch)
                      for r in range(WORKERS)]
        self.log, self.epoch, self.model, self.opt = log, epoch, model, opt
        self.durable = -1 if resume is None else resume.step
        self.ranks[0].start_lineage(resume)
        if resume is not None:
            model.load_state_dict(resume.model_state)
        version = 0 if resume is None else resume.weights_version
        log.add("weights_published", version=version, epoch=epoch, checksum=weights_checksum(model))
        log.add("member_ready", role="trainer", epoch=epoch, resume_step=version, weights_version=version)

    def train(self, step: int, *, upload: bool = True, log: bool = True) -> str:
        self.model(torch.randn(4, 8)).pow(2).sum().backward()
        self.opt.step()
        self.opt.zero_grad()
        if upload:
            self.ranks[0].snapshot(step, model_state=self.model.state_dict(), optim_state=self.opt.state_dict(),
                                   rng=capture_rng(), data_cursor=step + 1, weights_version=step + 1)
            self.ranks[1].snapshot(step, rng=capture_rng(), data_cursor=step + 1, weights_version=step + 1)
            for ck in self.ranks:
                ck.wait_uploaded(30)
                assert ck.last_error is None, ck.last_error
            self.durable = step
        checksum = weights_checksum(self.model)
        if log:
            self.log.add("weights_published", version=step + 1, epoch=self.epoch, checksum=checksum)
            self.log.add("step_committed", step=step, epoch=self.epoch, weights_version=step + 1,
                         checksum=checksum, durable_step=self.durable)
        return checksum


def _model() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 4))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _new_log(steps: int) -> Log:
    log = Log()
    log.add("job_submitted", spec={"steps": steps, "trainer": {"workers": WORKERS},
                                   "data": {"prompts_per_step": 1, "group_size": 1}})
    log.add("job_started")
    return log


def _audit(store: ObjectStore, job: str, log: Log, ended: bool = True) -> Any:
    events = [*log.events, RawEvent(len(log.events) + 1, "job_finished", float(len(log.events) + 1), {})] \
        if ended else log.events
    return judge(AuditInput(job_id=job, events=events, redis=RawRedis(), checkpoints=scan_checkpoints(store, job),
                            origins=scan_origins(store, job)), AuditOptions(require_ended=ended))


def _one_gang_job(tmp_path: Path, steps: int = 3) -> tuple[FileObjectStore, str, Log]:
    store, job = FileObjectStore(tmp_path), "j1"
    log = _new_log(steps)
    gang = Gang(store, job, log, 1, *_model(), resume=None)
    for step in range(steps):
        gang.train(step)
    return store, job, log


def _manifest(store: ObjectStore, job: str, step: int, epoch: int = 1) -> tuple[str, dict[str, Any]]:
    key = f"{_prefix(job)}/{step:012d}/e{epoch:08d}/manifest.json"
    return key, json.loads(store.get(key))


def test_a_sound_checkpointed_job_passes_and_its_weights_are_recomputed(tmp_path: Path):
    store, job, log = _one_gang_job(tmp_path)
    report = _audit(store, job, log)
    assert report.ok, _violations(report)
    assert report.facts["newest_loadable_checkpoint"] == 2
    assert report.facts["checkpoints_weights_verified"] == 3, report.facts


def test_a_checkpoint_whose_model_is_not_what_was_published_fails(tmp_path: Path):
    """Rank 0's tensors re-saved with other weights and the manifest re-signed to match: every
    blob verifies against its manifest, and only hashing the model finds the difference."""
    store, job, log = _one_gang_job(tmp_path)
    mkey, manifest = _manifest(store, job, 2)
    folder = mkey.rsplit("/", 1)[0]
    structure = torch.load(io.BytesIO(store.get(f"{folder}/r00000/state.pt")), weights_only=True)
    index = next(iter(structure["model"].values()))[REF]  # a tensor of the model, not of the optimizer
    blob = next(b for b in manifest["blobs"] if b["name"].startswith("r00000/tensors-"))
    tensors = torch.load(io.BytesIO(store.get(f"{folder}/{blob['name']}")), weights_only=True)
    tensors[index] = tensors[index] + 1.0
    buf = io.BytesIO()
    torch.save(tensors, buf)
    data = buf.getvalue()
    store.put(f"{folder}/{blob['name']}", data)
    blob.update(sha256=hashlib.sha256(data).hexdigest(), bytes=len(data))
    store.put(mkey, json.dumps(manifest).encode())
    report = _audit(store, job, log)
    assert report.checks["checkpoints"].passed, _violations(report)  # every blob matches its manifest
    assert not report.ok and any("step 2" in v and "published" in v for v in report.violations()), \
        _violations(report)


def test_a_published_checksum_other_than_the_checkpointed_model_fails(tmp_path: Path):
    store, job, log = _one_gang_job(tmp_path)
    log.events = [RawEvent(e.seq, e.kind, e.ts, {**e.data, "checksum": "f" * 64})
                  if e.kind in ("weights_published", "step_committed") and e.data.get("weights_version",
                                                                                      e.data.get("version")) == 2
                  else e for e in log.events]
    report = _audit(store, job, log)
    assert not report.ok and any("step 1" in v and "f" * 12 in v for v in report.violations()), _violations(report)


def test_a_checkpoint_missing_a_ranks_shard_is_not_loadable(tmp_path: Path):
    store, job, log = _one_gang_job(tmp_path)
    mkey, manifest = _manifest(store, job, 2)
    manifest["blobs"] = [b for b in manifest["blobs"] if b["rank"] == 0]  # rank 1's shard not named
    store.put(mkey, json.dumps(manifest).encode())
    report = _audit(store, job, log)
    assert not report.checks["checkpoints"].passed, _violations(report)
    assert any("rank 1" in v for v in report.violations()), _violations(report)
    assert report.facts["newest_loadable_checkpoint"] == 1
    # ...and the trainer had reported checkpoint 2 durable: a claim nothing loadable backs.
    assert any("durable" in v and "2" in v for v in report.checks["checkpoints"].violations), _violations(report)


def test_a_manifest_shrinking_the_gang_is_caught(tmp_path: Path):
    store, job, log = _one_gang_job(tmp_path)
    mkey, manifest = _manifest(store, job, 2)
    manifest["blobs"] = [b for b in manifest["blobs"] if b["rank"] == 0]
    manifest["world_size"] = 1  # says so itself, but the gang had two ranks
    store.put(mkey, json.dumps(manifest).encode())
    report = _audit(store, job, log)
    assert not report.checks["checkpoints"].passed, _violations(report)
    assert any("world_size 1" in v for v in report.violations()), _violations(report)


def test_a_blob_outside_its_checkpoints_folder_is_caught(tmp_path: Path):
    store, job, log = _one_gang_job(tmp_path)
    mkey, manifest = _manifest(store, job, 2)
    _, older = _manifest(store, job, 1)
    # Rank 1's state blob "borrowed" from checkpoint 1's folder, with that blob's own sha256.
    theirs = next(b for b in older["blobs"] if b["name"] == "r00001/state.pt")
    ours = next(b for b in manifest["blobs"] if b["name"] == "r00001/state.pt")
    ours.update(theirs, key=f"{_prefix(job)}/{1:012d}/e{1:08d}/r00001/state.pt")
    store.put(mkey, json.dumps(manifest).encode())
    report = _audit(store, job, log)
    assert not report.checks["checkpoints"].passed, _violations(report)
    assert any("outside" in v for v in report.violations()), _violations(report)


def test_a_durable_step_beyond_every_loadable_checkpoint_fails(tmp_path: Path):
    store, job = FileObjectStore(tmp_path), "j4"
    log = _new_log(3)
    gang = Gang(store, job, log, 1, *_model(), resume=None)
    gang.train(0)
    gang.train(1)
    gang.train(2, upload=False)
    # Its commit claims checkpoint 2 durable, but no manifest of step 2 exists.
    e = log.events[-1]
    log.events[-1] = RawEvent(e.seq, e.kind, e.ts, {**e.data, "durable_step": 2})
    report = _audit(store, job, log, ended=False)
    assert not report.checks["checkpoints"].passed, _violations(report)
    assert any("durable" in v for v in report.checks["checkpoints"].violations), _violations(report)


def test_a_zombie_manifest_off_the_origin_chain_is_not_the_newest_loadable(tmp_path: Path):
    """Gang 2 resumed from checkpoint 2 of gang 1; gang 1's uploads of steps 3 and 4 (a zombie:
    they landed after the take-over) are off the chain. Counted as durable, gang 1's checkpoint 4
    let the collection of step 4's batch pass, though a redo from checkpoint 3 needs it."""
    store, job = FileObjectStore(tmp_path), "j2"
    log = _new_log(5)
    g1 = Gang(store, job, log, 1, *_model(), resume=None)
    for step in range(3):
        g1.train(step)
    g2 = Gang(store, job, log, 2, *_model(), resume=Checkpointer(store, _prefix(job)).load(2, 1))
    g1.train(3, log=False)
    g1.train(4, log=False)  # its manifests land after gang 2 chose where to resume
    g2.train(3)
    g2.train(4, upload=False)  # committed; its checkpoint not durable yet when the job is audited
    report = _audit(store, job, log, ended=False)
    assert report.facts["newest_loadable_checkpoint"] == 3, report.facts
    assert any("step 4" in v and "before its checkpoint was durable" in v for v in report.violations()), \
        _violations(report)


def test_a_gang_resuming_with_weights_other_than_its_origin_checkpoint_fails(tmp_path: Path):
    store, job = FileObjectStore(tmp_path), "j3"
    log = _new_log(4)
    model, opt = _model()
    g1 = Gang(store, job, log, 1, model, opt, resume=None)
    g1.train(0)
    g1.train(1)
    g1.train(2, upload=False)  # gang 1 dies during the upload of checkpoint 2
    g2 = Gang(store, job, log, 2, *_model(), resume=Checkpointer(store, _prefix(job)).load(1, 1))
    g2.train(2)
    g2.train(3)
    assert _audit(store, job, log).ok, _violations(_audit(store, job, log))
    # Gang 2's first publication (v2, the weights it resumed with) names other weights.
    first = next(i for i, e in enumerate(log.events) if e.kind == "weights_published" and e.data["epoch"] == 2)
    e = log.events[first]
    log.events[first] = RawEvent(e.seq, e.kind, e.ts, {**e.data, "checksum": "e" * 64})
    report = _audit(store, job, log)
    assert not report.ok and any("gang 2" in v and "e" * 12 in v for v in report.violations()), _violations(report)

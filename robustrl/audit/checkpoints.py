"""Checkpoint invariants, judged from the object store as scanned raw and the event log.

A checkpoint is *fully loadable* when every blob its manifest names is present, inside its own
rank's folder, and matches its size and sha256 (``checkpoint_scan``), and the manifest covers its
gang: a ``state.pt`` for every rank of ``world_size`` (the job's trainer gangs' size), nothing of a
rank beyond it, and the weights version its step makes (step k trains version k + 1).

Which manifests count is the chain of gang origins (the format's rule, ``checkpoint_catalog``):
the newest gang that recorded an origin owns its manifests above the checkpoint it resumed from;
that checkpoint's gang owns its own down to where it resumed, and so on back. A manifest off the
chain was written by a gang already replaced (an upload that landed after the take-over) and is
never loaded. Without origins (synthetic input, or folders written before origins existed), an
older gang's manifest at or above a newer gang's step is superseded. The newest fully loadable
checkpoint on the chain is the job's durable progress: a ``durable_step`` the trainer reported
beyond it is a claim nothing backs.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from robustrl.audit.lineage import JobFacts, _int, of_kind
from robustrl.audit.model import AuditInput, CheckResult
from robustrl.audit.raw import RawCheckpoint


@dataclass(frozen=True)
class Lineage:
    """The manifests on the final lineage, newest step first, and the newest fully loadable one."""

    chain: list[RawCheckpoint]
    newest: RawCheckpoint | None

    @property
    def newest_step(self) -> int:
        """Step of the newest fully loadable checkpoint on the chain (-1: none)."""
        return -1 if self.newest is None or self.newest.step is None else self.newest.step


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def structure_problems(ck: RawCheckpoint, workers: int | None) -> list[str]:
    """What keeps ``ck``'s manifest from describing a whole checkpoint of its gang."""
    m = ck.manifest
    if m is None:
        return []
    out: list[str] = []
    ws = m.get("world_size")
    if not _is_int(ws) or ws < 1:
        out.append(f"manifest names no world size ({ws!r})")
        ws = None
    elif workers is not None and ws != workers:
        out.append(f"manifest says world_size {ws}, but the job's trainer gangs have {workers} ranks")
    blobs = [b for b in m.get("blobs") or [] if isinstance(b, dict)] if isinstance(m.get("blobs"), list) else []
    ranks = {b["rank"] for b in blobs if _is_int(b.get("rank"))}
    states = {b["rank"] for b in blobs if _is_int(b.get("rank")) and b.get("name") == f"r{b['rank']:05d}/state.pt"}
    if ws is not None:
        out.extend(f"rank {r} of {ws} wrote no shard (no r{r:05d}/state.pt)" for r in range(ws) if r not in states)
        beyond = sorted(r for r in ranks if not 0 <= r < ws)
        if beyond:
            out.append(f"blobs of rank(s) {beyond} beyond world_size {ws}")
    version = m.get("weights_version")
    if not _is_int(version):
        out.append(f"manifest names no weights version ({version!r})")
    elif ck.step is not None and version != ck.step + 1:
        out.append(f"checkpoint of step {ck.step} names weights version {version} "
                   f"(training step {ck.step} makes version {ck.step + 1})")
    return out


def fully_loadable(ck: RawCheckpoint, workers: int | None) -> bool:
    return ck.loadable and ck.step is not None and not structure_problems(ck, workers)


def parse_origin(value: Any, epoch: int) -> tuple[int, int] | None:
    """(from_step, from_epoch) of gang ``epoch``'s origin; None: it started from the initial weights.

    Raises:
        ValueError: the origin is missing, names another gang, or names half a checkpoint.
    """
    if not isinstance(value, dict) or value.get("epoch") != epoch:
        raise ValueError(f"gang {epoch} has no readable origin")
    step, origin_epoch = value.get("from_step"), value.get("from_epoch")
    if step is None and origin_epoch is None:
        return None
    if _is_int(step) and _is_int(origin_epoch) and step >= 0 and origin_epoch >= 0:
        return step, origin_epoch
    raise ValueError(f"gang {epoch}'s origin names checkpoint {step!r} of gang {origin_epoch!r}")


def _superseding(manifests: Iterable[RawCheckpoint]) -> list[RawCheckpoint]:
    """Newest step first, one per step: ``(s, e)`` is superseded by any ``(s2, e2)`` with a newer
    epoch ``e2`` at a step ``s2 <= s`` (that gang resumed below ``s``, so ``e``'s write at ``s``
    came after the take-over). A folder without an epoch counts as the oldest."""
    out: list[RawCheckpoint] = []
    newest_below = -2
    for ck in sorted(manifests, key=lambda c: (_step(c), -_epoch(c))):
        if _epoch(ck) >= newest_below and (not out or out[-1].step != ck.step):
            out.append(ck)
        newest_below = max(newest_below, _epoch(ck))
    return out[::-1]


def _epoch(ck: RawCheckpoint) -> int:
    return -1 if ck.epoch is None else ck.epoch


def _step(ck: RawCheckpoint) -> int:
    return -1 if ck.step is None else ck.step


def lineage(inp: AuditInput, facts: JobFacts) -> Lineage:
    """The final lineage's manifests (module docstring) and its newest fully loadable one."""
    manifests = [ck for ck in inp.checkpoints if ck.manifest is not None and ck.step is not None]
    chain: list[RawCheckpoint] = []
    if not inp.origins:
        chain = _superseding(manifests)
    else:
        epoch, upper = max(inp.origins), None
        while True:
            below = [ck for ck in manifests if upper is None or _step(ck) <= upper]
            try:
                origin = parse_origin(inp.origins.get(epoch), epoch)
            except ValueError:  # judged by the older rule from here down (trained_once names it)
                chain += _superseding(ck for ck in below if _epoch(ck) <= epoch)
                break
            lower = -1 if origin is None else origin[0]
            chain += sorted((ck for ck in below if ck.epoch == epoch and _step(ck) > lower),
                            key=lambda c: -_step(c))
            if origin is None or origin[1] >= epoch:
                break  # a gang resumes only from an older one's checkpoint: the chain ends here
            epoch, upper = origin[1], origin[0]
    newest = next((ck for ck in chain if fully_loadable(ck, facts.trainer_workers)), None)
    return Lineage(chain, newest)


def check_checkpoints(inp: AuditInput, facts: JobFacts) -> tuple[CheckResult, int, Lineage]:
    """Every manifest loads and covers its gang; a job with commits keeps a fully loadable one on
    its final lineage; no durable step reported beyond it. Returns (result, manifests that would
    not load, the final lineage)."""
    res = CheckResult()
    bad = 0
    for ck in inp.checkpoints:
        problems = ck.problems + structure_problems(ck, facts.trainer_workers)
        if problems:
            bad += 1
            res.violations.append(f"{ck.manifest_key}: " + "; ".join(problems))
    lin = lineage(inp, facts)
    if facts.final_step >= 0 and lin.newest is None:
        res.violations.append("steps were committed but no loadable checkpoint is left in the object store "
                              "on the final lineage of gang origins")
    claims = [(e, _int(e.data.get("durable_step"))) for e in of_kind(inp.events, "step_committed")]
    claim = max(claims, key=lambda c: c[1], default=None)
    if claim is not None and claim[1] > lin.newest_step:
        res.violations.append(
            f"gang {claim[0].data.get('epoch')} reported checkpoint {claim[1]} durable (event seq {claim[0].seq}), "
            f"but the newest fully loadable checkpoint on the final lineage is {lin.newest_step}")
    res.passed = not res.violations
    return res, bad, lin

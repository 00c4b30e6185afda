"""Weights invariants: what replicas loaded and what checkpoints hold, against what each trainer
gang published.

Publications are keyed by gang and version, never by version alone: two gangs publish the same
version number with other weights when a newer gang redoes a step (it resumed before that step's
checkpoint was durable). A gang is *superseded* from the first publication of a newer gang in the
log on (replicas follow the newest gang from its first announcement, which follows that event):

* a replica's load must come after a publication of that version and checksum by a gang not
  superseded at the time of the load. A load logged before the replacement is sound even when
  its gang is replaced later (replicas keep serving what they have until the redo announces);
* a checkpoint's model, hashed again from its blobs, must be what its gang published for that
  version (and committed for that step), and what every gang that resumed from it published as
  the version it resumed with.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Any

from robustrl.audit.checkpoints import Lineage, parse_origin
from robustrl.audit.lineage import JobFacts, _int, of_kind, training_records
from robustrl.audit.model import AuditInput, CheckResult
from robustrl.audit.rollout import StepView

REJECT_KINDS = ("weights_rejected",)
"""Events a replica emits when a pulled version fails its checksum."""
NEVER = float("inf")


@dataclass(frozen=True)
class Publication:
    seq: int
    epoch: int
    version: int
    checksum: str


@dataclass(frozen=True)
class Publications:
    """Every ``weights_published`` event, and when each gang was superseded."""

    all: list[Publication]
    superseded_at: dict[int, float]
    """gang epoch -> seq of the first publication by a newer gang (absent: never)."""

    @classmethod
    def of(cls, inp: AuditInput) -> Publications:
        pubs = [Publication(e.seq, _int(e.data.get("epoch")), _int(e.data.get("version")), str(e.data.get("checksum")))
                for e in of_kind(inp.events, "weights_published")]
        first: dict[int, int] = {}
        for p in pubs:
            first[p.epoch] = min(first.get(p.epoch, p.seq), p.seq)
        # A gang is superseded from the first publication of any newer gang, even one logged
        # before its own first (a stale gang that publishes only after its replacement did).
        superseded: dict[int, float] = {}
        newer_first = NEVER
        for epoch in sorted(first, reverse=True):
            if newer_first < NEVER:
                superseded[epoch] = newer_first
            newer_first = min(newer_first, first[epoch])
        return cls(pubs, superseded)

    def live_at(self, p: Publication, seq: int) -> bool:
        """Whether ``p`` was published before ``seq`` by a gang not superseded by then."""
        return p.seq < seq and self.superseded_at.get(p.epoch, NEVER) > seq

    def by(self, epoch: int | None, version: int) -> list[Publication]:
        return [p for p in self.all if p.version == version and (epoch is None or p.epoch == epoch)]


def check_weights(inp: AuditInput, views: list[StepView], facts: JobFacts) -> tuple[CheckResult, int, int]:
    """Every load is of weights a live gang had published, never of a checksum the replica
    rejected; every assistant turn was made by a replica that loaded that version soundly, and
    names (``weights_checksum``, where it does) weights published as its version; the Redis
    pointer names a publication of its own gang (of the newest gang, once the job finished).

    Returns the check, how many (replica, version) pairs served bad or unloaded weights, and how
    many had no load event and were judged by their turns' checksums alone (a replica killed with
    its ``weights_loaded`` still owed and not in the job's rollout outbox: its save to Redis failed,
    or no replica of the job started after to append it)."""
    res = CheckResult()
    pubs = Publications.of(inp)
    rejected: dict[tuple[str, int], set[str]] = defaultdict(set)
    for e in of_kind(inp.events, *REJECT_KINDS):
        rejected[(str(e.data.get("member_id")), _int(e.data.get("version")))].add(str(e.data.get("checksum")))
    good: set[tuple[str, int]] = set()
    bad: set[tuple[str, int]] = set()
    for e in of_kind(inp.events, "weights_loaded"):
        key = (str(e.data.get("member_id")), _int(e.data.get("version")))
        checksum = str(e.data.get("checksum"))
        same = [p for p in pubs.by(None, key[1]) if p.checksum == checksum]
        problem = None
        if not same:
            problem = f"loaded v{key[1]} with checksum {checksum[:12]} the trainer never published"
        elif not any(p.seq < e.seq for p in same):
            problem = f"loaded v{key[1]} ({checksum[:12]}) before the trainer published it"
        elif not any(pubs.live_at(p, e.seq) for p in same):
            gangs = sorted({p.epoch for p in same})
            since = min(pubs.superseded_at[g] for g in gangs)
            problem = (f"loaded v{key[1]} ({checksum[:12]}) published only by gang(s) {gangs}, superseded by a newer "
                       f"gang's publication (event seq {since}) before the load")
        elif checksum in rejected.get(key, set()):
            problem = f"loaded v{key[1]} after rejecting that checksum"
        if problem is None:
            good.add(key)
        else:
            bad.add(key)
            res.violations.append(f"{key[0]} {problem} (event seq {e.seq})")
    unloaded: set[tuple[str, int]] = set()
    by_turn: set[tuple[str, int]] = set()  # sound by the turns' own checksums alone (no load event)
    for v in views:
        for eid, ep in v.episodes.items():
            for t in (ep or {}).get("turns") or []:
                member = t.get("member_id") if isinstance(t, dict) else None
                if not isinstance(t, dict) or t.get("role") != "assistant" or not member:
                    continue
                key = (str(member), _int(t.get("weights_version")))
                served = t.get("weights_checksum")
                if isinstance(served, str) and served:
                    # The turn names the weights it was made with: they must be a publication of
                    # its version, whatever the load events say.
                    if served not in {p.checksum for p in pubs.by(None, key[1])}:
                        if key not in bad:
                            bad.add(key)
                            res.violations.append(f"{key[0]} served v{key[1]} (episode {eid}) with checksum "
                                                  f"{served[:12]} the trainer never published as v{key[1]}")
                        continue
                    if key not in good and key not in bad:
                        # Its load event lost (the replica killed while it was still owed): the
                        # turn's own record of its weights judges it.
                        by_turn.add(key)
                        continue
                if key not in good and key not in bad and key not in unloaded and key not in by_turn:
                    unloaded.add(key)
                    res.violations.append(f"{key[0]} served v{key[1]} (episode {eid}) but never loaded a "
                                          f"published v{key[1]}")
    res.violations.extend(_foreign_turns_trained(inp, views, pubs))
    res.violations.extend(_pointer_problems(inp.redis.weights_pointer, pubs, facts))
    res.passed = not res.violations
    return res, len(bad | unloaded), len(by_turn)


def _foreign_turns_trained(inp: AuditInput, views: list[StepView], pubs: Publications) -> list[str]:
    """A step's turns judged against the gang that trained it last: an assistant turn of a
    version that gang published, made with other weights (a replica still serving a dead gang's
    version, which the new gang made again after a rollback with weights that differ), is not that
    gang's policy, and it must have dropped it (``stale_turns_dropped``: the step's dropped turns
    are at least as many as such turns). Versions the gang did not publish (older than its
    resume) are its ancestors' and judged by ``check_weights`` alone."""
    trained_by = training_records(inp).committed_by
    dropped: dict[tuple[int, int], int] = defaultdict(int)
    for e in of_kind(inp.events, "stale_turns_dropped"):
        dropped[(_int(e.data.get("step")), _int(e.data.get("epoch")))] += max(0, _int(e.data.get("turns")))
    out = []
    for v in views:
        gang = trained_by.get(v.step)
        if gang is None:
            continue
        foreign: list[str] = []
        for eid, ep in v.episodes.items():
            for t in (ep or {}).get("turns") or []:
                if not isinstance(t, dict) or t.get("role") != "assistant":
                    continue
                served, version = t.get("weights_checksum"), _int(t.get("weights_version"))
                own = {p.checksum for p in pubs.by(gang, version)}
                if isinstance(served, str) and served and own and served not in own:
                    foreign.append(f"{eid} v{version} ({served[:12]}, gang {gang}'s: {min(own)[:12]})")
        if len(foreign) > dropped.get((v.step, gang), 0):
            out.append(f"step {v.step}: gang {gang} trained {len(foreign)} turns of its own versions made with other "
                       f"weights and dropped {dropped.get((v.step, gang), 0)}, e.g. {foreign[0]}")
    return out


def _pointer_problems(pointer: dict[str, Any] | None, pubs: Publications, facts: JobFacts) -> list[str]:
    if pointer is None:
        return []
    epoch = pointer.get("epoch")
    epoch = epoch if isinstance(epoch, int) and not isinstance(epoch, bool) else None
    version = _int(pointer.get("version"))
    if str(pointer.get("checksum")) not in {p.checksum for p in pubs.by(epoch, version)}:
        return [f"Redis weights pointer names v{version} of gang {epoch} with a checksum that gang never published"]
    newest = max((p.epoch for p in pubs.all), default=-1)
    if facts.finished and epoch is not None and epoch < newest:
        return [f"Redis weights pointer names v{version} of gang {epoch}, superseded by gang {newest}"]
    return []


def check_checkpoint_weights(inp: AuditInput, facts: JobFacts, lin: Lineage) -> tuple[CheckResult, dict[str, int]]:
    """The model in each checkpoint (hashed from its blobs at the scan) is what was published for
    it: by its own gang for its weights version, in its gang's commit of its step, and by every
    gang that resumed from it. The newest loadable checkpoint of a finished job must have been
    published (a job cannot end on weights nobody announced)."""
    res = CheckResult()
    pubs = Publications.of(inp)
    commits = {(_int(e.data.get("step")), _int(e.data.get("epoch"))): str(e.data.get("checksum"))
               for e in of_kind(inp.events, "step_committed") if e.data.get("checksum") is not None}
    resumed_from: dict[tuple[int, int], list[int]] = defaultdict(list)
    for gang, value in (inp.origins or {}).items():
        try:
            origin = parse_origin(value, gang)
        except ValueError:
            continue  # trained_once reports a gang without a readable origin
        if origin is not None:
            resumed_from[origin].append(gang)
    counts = {"checkpoints_weights_verified": 0, "checkpoints_weights_unpublished": 0,
              "checkpoints_weights_unhashed": 0}
    for ck in inp.checkpoints:
        if ck.manifest is None or ck.step is None or ck.problems:
            continue  # not loadable: the checkpoints check reports it
        if ck.weights_checksum is None:
            counts["checkpoints_weights_unhashed"] += 1
            continue
        version = _int(ck.manifest.get("weights_version"))
        claims = [(f"gang {p.epoch} published", p.checksum) for p in pubs.by(ck.epoch, version)]
        if ck.epoch is not None:
            if (ck.step, ck.epoch) in commits:
                claims.append((f"gang {ck.epoch}'s commit of step {ck.step} says", commits[(ck.step, ck.epoch)]))
            for gang in resumed_from.get((ck.step, ck.epoch), []):
                claims += [(f"gang {gang}, which resumed from it, published", p.checksum) for p in pubs.by(gang, version)]
        if not claims:
            counts["checkpoints_weights_unpublished"] += 1
            if ck is lin.newest and facts.finished:
                res.violations.append(f"{ck.manifest_key}: the newest loadable checkpoint's weights (v{version}) were "
                                      "never published by its gang or by a gang resuming from it")
            continue
        counts["checkpoints_weights_verified"] += 1
        for who, checksum in claims:
            if checksum != ck.weights_checksum:
                res.violations.append(f"checkpoint of step {ck.step} (gang {ck.epoch}) holds weights "
                                      f"{ck.weights_checksum[:12]}, but {who} {checksum[:12]} for v{version}")
    res.passed = not res.violations
    return res, counts

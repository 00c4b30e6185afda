"""What the Docker launcher reads and writes of a warm spare container (``DockerLauncher.keep_spares``).

A spare is a container of the member image running ``python -m robustrl.launcher.spare --handoff
DIR``: the member code imported, waiting for a hand-off. This module holds what identifies one
from the engine alone, so that a restarted controller's launcher can tell its states apart:

* its labels: the launcher's instance and :data:`LABEL_SPARE` (the limits it was created with, as
  :class:`SpareShape`); no member label, so ``find`` and ``adopt`` never take a spare for a member;
* waiting and ready: its output says ``spare <pid> ready`` (``spare.become_member``);
* taken: the hand-off put into it also leaves :data:`MEMBER_MARK` (the member's id, no
  credential), read back with ``get_archive``; the container's labels stay as created.
"""

from __future__ import annotations

import io
import json
import math
import re
import tarfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from robustrl.launcher.base import Resources
from robustrl.launcher.spare import handoff_order

LABEL_SPARE = "robustrl.spare"
"""On a spare's container: the limits it was created with (:meth:`SpareShape.label`)."""
MEMBER_MARK = "robustrl-member.json"
"""In a spare's hand-off directory once it is taken: ``{"member_id": ...}`` (readable, no credential)."""
_READY = re.compile(r"^spare (\d+) ready$", re.MULTILINE)


@dataclass(frozen=True)
class SpareShape:
    """A container's resource limits as a member spec asks for them (``DockerLauncher._resource_kwargs``):
    CPUs and memory (None: no limit), and its GPU access (``gpus`` devices, or ``all_gpus``)."""

    cpus: float | None = None
    memory_mb: int | None = None
    gpus: int = 0
    all_gpus: bool = False

    @classmethod
    def of(cls, resources: Resources, all_gpus: bool) -> SpareShape:
        """The limits a member with ``resources`` gets (``all_gpus``: its role takes every GPU)."""
        gpus = 0 if all_gpus or not resources.gpus else max(1, math.ceil(resources.gpus))
        return cls(resources.cpus or None, resources.memory_mb or None, gpus, all_gpus)

    def covers(self, want: SpareShape) -> bool:
        """Whether a container with these limits may run a member that asks for ``want``: no
        tighter a limit (none covers any; a limit covers a smaller one, never none), as a borrowed
        replica's reservation must cover a rank's (``view.replica_fits_trainer``); and the same
        GPU access, which is fixed when the container is created (a member must not sit on
        devices it did not ask for)."""
        if (self.gpus, self.all_gpus) != (want.gpus, want.all_gpus):
            return False
        if self.cpus is not None and (want.cpus is None or want.cpus > self.cpus):
            return False
        return self.memory_mb is None or (want.memory_mb is not None and want.memory_mb <= self.memory_mb)

    def label(self) -> str:
        return json.dumps({"cpus": self.cpus, "memory_mb": self.memory_mb, "gpus": self.gpus,
                           "all_gpus": self.all_gpus}, sort_keys=True)

    @classmethod
    def from_label(cls, value: str | None) -> SpareShape | None:
        """The shape a :meth:`label` names; None for anything else."""
        try:
            d = json.loads(value or "")
            return cls(None if d["cpus"] is None else float(d["cpus"]),
                       None if d["memory_mb"] is None else int(d["memory_mb"]), int(d["gpus"]), bool(d["all_gpus"]))
        except (KeyError, TypeError, ValueError):
            return None


def ready_pid(container: Any) -> int | None:
    """The pid (inside its container) of a spare whose imports are done, from its output; None
    while it imports. Raises what the docker SDK raises."""
    found = _READY.search(container.logs().decode(errors="replace"))
    return int(found.group(1)) if found else None


def _read_file(container: Any, path: str) -> bytes | None:
    """A file's bytes out of a container; None if it is not there. Raises what the docker SDK
    raises, but not-found."""
    try:
        stream, _stat = container.get_archive(path)
    except Exception as exc:
        if getattr(exc, "status_code", None) == 404 or type(exc).__name__ == "NotFound":
            return None
        raise
    with tarfile.open(fileobj=io.BytesIO(b"".join(stream))) as tar:
        for info in tar.getmembers():
            f = tar.extractfile(info)
            if f is not None:
                return f.read()
    return None


def spare_member(container: Any, directory: str) -> str | None:
    """The member a spare's container runs (its :data:`MEMBER_MARK`); None while it waits, and
    while the hand-off the mark names is still there (written, the signal not taken yet: a
    controller that died in between left a spare that still waits). Raises what the docker SDK
    raises, but not-found."""
    raw = _read_file(container, f"{directory}/{MEMBER_MARK}")
    try:
        mark = json.loads(raw) if raw is not None else None
    except ValueError:
        return None
    member = mark.get("member_id") if isinstance(mark, dict) else None
    if not isinstance(member, str):
        return None
    handoff = mark.get("handoff")
    if isinstance(handoff, str) and handoff and _read_file(container, f"{directory}/{handoff}") is not None:
        return None  # not taken: the spare still waits
    return member


def handoff_tar(name: str, env: Mapping[str, str], uid: int, gid: int, module: str | None = None,
                args: Sequence[str] = (), member_id: str | None = None) -> bytes:
    """A tar of the hand-off file ``name`` (``spare.handoff_order``'s content; no log: the output
    stays the container's), owned by the member's user and readable by it alone (it carries
    credentials); with ``member_id`` (a spare taken) also the :data:`MEMBER_MARK`."""
    files = [(name, json.dumps(handoff_order(env, "", module, args)).encode(), 0o600)]
    if member_id is not None:
        files.append((MEMBER_MARK, json.dumps({"member_id": member_id, "handoff": name}).encode(), 0o644))
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for file_name, data, mode in files:
            info = tarfile.TarInfo(file_name)
            info.size, info.mode, info.uid, info.gid, info.mtime = len(data), mode, uid, gid, int(time.time())
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()

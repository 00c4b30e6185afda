"""Weight buffers another process can map: memfd segments, named by ``/proc/<pid>/fd/<fd>``.

The vLLM engine's model lives in vLLM's engine process. A version the replica pulls into one of
these segments reaches that process with no copy: vLLM's worker maps the segment and loads
from views into it (:mod:`robustrl.model.engines.vllm_plugin`). A memfd has no name in the file
system, so a replica that crashes leaves nothing behind (the kernel frees it with the last
mapping); a segment's file descriptor is closed when its mapping is collected (every array
and tensor viewing it holds the mapping).
"""

from __future__ import annotations

import mmap
import os
import threading
import weakref
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np


def supported() -> bool:
    """memfd segments need Linux (``os.memfd_create`` and ``/proc``)."""
    return hasattr(os, "memfd_create") and os.path.isdir(f"/proc/{os.getpid()}/fd")


@dataclass(frozen=True)
class _Segment:
    fd: int
    base: int
    nbytes: int
    mapping: weakref.ref[mmap.mmap]


class Segments:
    """memfd segments of this process, found again from a tensor's address."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._live: dict[int, _Segment] = {}  # by fd

    def alloc(self, nbytes: int) -> np.ndarray:
        """A zero-filled uint8 array of ``nbytes`` in a new segment."""
        fd = os.memfd_create("robustrl-weights", os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, nbytes)
            mm = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(fd)
            raise
        arr = np.frombuffer(mm, dtype=np.uint8)
        seg = _Segment(fd, int(arr.ctypes.data), nbytes, weakref.ref(mm))
        with self._lock:
            self._live[fd] = seg
        weakref.finalize(mm, self._release, fd)
        return arr

    def _release(self, fd: int) -> None:
        with self._lock:
            self._live.pop(fd, None)
        try:
            os.close(fd)
        except OSError:
            pass

    def __len__(self) -> int:
        with self._lock:
            return len(self._live)

    def locate(self, state: Mapping[str, Any]) -> tuple[str, int, list[list[Any]]] | None:
        """Where ``state``'s tensors lie, if all of them view one live segment: its path for
        another process, its size, and ``[name, dtype, shape, offset]`` of each tensor; None
        otherwise (another buffer, a non-contiguous or non-CPU tensor)."""
        tensors = [(name, t) for name, t in state.items()]
        if not tensors:
            return None
        with self._lock:
            segs = list(self._live.values())
        first = next((t for _, t in tensors if t.numel()), tensors[0][1])
        if first.device.type != "cpu":
            return None
        ptr = first.data_ptr()
        seg = next((s for s in segs if s.base <= ptr < s.base + s.nbytes and s.mapping() is not None), None)
        if seg is None:
            return None
        out: list[list[Any]] = []
        for name, t in tensors:
            nbytes = t.numel() * t.element_size()
            off = t.data_ptr() - seg.base if nbytes else 0
            if t.device.type != "cpu" or not t.is_contiguous() or off < 0 or off + nbytes > seg.nbytes:
                return None
            out.append([name, str(t.dtype).removeprefix("torch."), list(t.shape), off])
        return f"/proc/{os.getpid()}/fd/{seg.fd}", seg.nbytes, out

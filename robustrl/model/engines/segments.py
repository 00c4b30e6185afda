"""Weight buffers another process can map: memfd segments, named by ``/proc/<pid>/fd/<fd>``.

The vLLM engine's model lives in vLLM's engine process. A version the replica pulls into one of
these segments reaches that process with no copy: vLLM's worker maps the segment
(:class:`SegmentMap`, the worker's side) and loads from views into it
(:mod:`robustrl.model.engines.vllm_plugin`). A memfd has no name in the file
system, so a replica that crashes leaves nothing behind (the kernel frees it with the last
mapping); a segment's file descriptor is closed when its mapping is collected (every array
and tensor viewing it holds the mapping).
"""

from __future__ import annotations

import logging
import mmap
import os
import threading
import weakref
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from robustrl.errors import WeightSyncError

log = logging.getLogger(__name__)


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


class SegmentMap:
    """The one replica segment this worker keeps mapped (MAP_POPULATE: page tables filled at
    once), from the replica's hint that it holds the next version until another is mapped.

    The replica allocates a segment per version it pulls; once the pull completed it asks for
    it to be mapped (:meth:`prefetch`: one thread of its own, the newest hint only; ``mmap``
    runs without the GIL) while it checks the version, so mapping it and unmapping the previous
    one are off the swap. A swap holds the mapping (:meth:`hold`; mapped by the swap itself if no hint came)
    until :meth:`release`, after vLLM's ``finish``: nothing unmaps a segment a load still reads
    (views into it do not keep it mapped).

    A segment is the file at its path now (``/proc/<pid>/fd/<fd>``: the replica may have closed
    that descriptor and reused its number). The replica names its inode; a file with another one
    is refused (a hint: ignored, the kept mapping left as it is), and only a memfd is mapped. The
    mapping kept is reused only for the same device, inode and size (it holds its file open, so
    no other file can have that inode meanwhile). Shared and writable so that populating never
    copies a page; nothing writes to it.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()  # the mapping: made, dropped, or held by a swap
        self._key: tuple[int, int, int] | None = None
        self._mm: mmap.mmap | None = None
        self._held = False
        self._retired: list[mmap.mmap] = []  # replaced during a hold: unmapped at its release
        self._hints = threading.Lock()
        self._hint: tuple[str, int, int] | None = None
        self._prefetching = False

    def hold(self, path: str, nbytes: int, ino: int = 0) -> mmap.mmap:
        """The mapping of the segment at ``path``, kept mapped until :meth:`release`.

        A second hold before the release (vLLM's own session API: several ``update_weights``
        before one ``finish``) keeps every segment held mapped until that release.

        Raises:
            WeightSyncError: not the replica's segment (another inode, not a memfd, too small).
        """
        if self._held:  # RPCs run one at a time in this thread: the lock is ours already
            return self._map(path, nbytes, ino)
        self._lock.acquire()
        try:
            mm = self._map(path, nbytes, ino)
        except BaseException:
            self._lock.release()
            raise
        self._held = True
        return mm

    def release(self) -> None:
        """End :meth:`hold` (harmless without one)."""
        if self._held:
            for old in self._retired:
                old.close()
            self._retired.clear()
            self._held = False
            self._lock.release()

    def prefetch(self, path: str, nbytes: int, ino: int) -> None:
        """Map that segment in the background (the replica's hint: it comes next)."""
        with self._hints:
            self._hint = (path, nbytes, ino)
            if self._prefetching:
                return
            self._prefetching = True
        threading.Thread(target=self._prefetch_newest, name="robustrl-segment-map", daemon=True).start()

    def _prefetch_newest(self) -> None:
        while True:
            with self._hints:
                hint, self._hint = self._hint, None
                if hint is None:
                    self._prefetching = False
                    return
            try:
                with self._lock:
                    self._map(*hint)
            except Exception as exc:  # noqa: BLE001 - only a hint: the swap maps it itself
                log.info("prefetching the mapping of %s: %r", hint[0], exc)

    def _map(self, path: str, nbytes: int, ino: int) -> mmap.mmap:
        """(lock held) The kept mapping if it is this segment's, else a new one replacing it."""
        fd = os.open(path, os.O_RDWR)
        try:
            st = os.fstat(fd)
            if ino and st.st_ino != ino:
                raise WeightSyncError(f"{path} is not the replica's segment (inode {st.st_ino}, {ino} expected)",
                                      reason="error")
            key = (st.st_dev, st.st_ino, nbytes)
            if self._mm is not None and not self._mm.closed and self._key == key:
                return self._mm
            try:
                memfd = os.readlink(path).startswith("/memfd:")
            except OSError:  # not a link: not a descriptor of the replica's
                memfd = False
            if not memfd or st.st_size < nbytes:
                raise WeightSyncError(f"{path} is not a weights segment of {nbytes} bytes", reason="error")
            flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
            mm = mmap.mmap(fd, nbytes, flags=flags, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        if self._mm is not None:
            if self._held:
                self._retired.append(self._mm)  # a load of this hold may still read it
            else:
                self._mm.close()  # nothing reads it: swaps hold the lock while they do
        self._mm, self._key = mm, key
        return mm

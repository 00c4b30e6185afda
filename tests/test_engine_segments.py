"""memfd weight segments (robustrl.model.engines.segments): what the vLLM engine's worker maps.

A version pulled into a segment reaches another process with no copy: the other process opens
``/proc/<pid>/fd/<fd>`` and maps the same pages. Runs without vLLM.
"""

from __future__ import annotations

import gc
import mmap
import os
import subprocess
import sys
import tempfile
import time

import numpy as np
import pytest
import torch
from support import eventually

from robustrl.model.engines import segments
from robustrl.model.engines.segments import Segments
from robustrl.weights.flat import flatten_state_dict, unflatten

pytestmark = pytest.mark.skipif(not segments.supported(), reason="memfd segments need Linux")


def test_a_pulled_state_is_located_in_its_segment_and_another_process_maps_the_same_bytes() -> None:
    segs = segments.Segments()
    state = {"a.weight": torch.arange(12, dtype=torch.float32).view(3, 4), "b": torch.ones(5, dtype=torch.bfloat16),
             "empty": torch.zeros(0)}
    src, manifest = flatten_state_dict(state, 1, 64)
    buf = segs.alloc(manifest.total_bytes)
    buf[:] = src.numpy()  # as the puller writes chunks into it
    views = unflatten(torch.from_numpy(buf), manifest)
    found = segs.locate(views)
    assert found is not None
    path, nbytes, tensors = found
    assert nbytes == manifest.total_bytes and path.startswith(f"/proc/{os.getpid()}/fd/")
    assert [t[0] for t in tensors] == list(state)
    assert [(t[1], t[2]) for t in tensors] == [("float32", [3, 4]), ("bfloat16", [5]), ("float32", [0])]
    # another process maps the segment and reads the tensors back (as vLLM's worker does)
    code = ("import json,mmap,os,sys,torch\n"
            "p,n,ts=json.loads(sys.argv[1])\n"
            "fd=os.open(p,os.O_RDWR); mm=mmap.mmap(fd,n,flags=mmap.MAP_SHARED,prot=mmap.PROT_READ|mmap.PROT_WRITE)\n"
            "flat=torch.frombuffer(mm,dtype=torch.uint8)\n"
            "name,dt,shape,off=ts[0]\n"
            "print(flat[off:off+48].view(torch.float32).view(*shape).sum().item())\n")
    import json

    out = subprocess.run([sys.executable, "-c", code, json.dumps([path, nbytes, tensors])], check=True,
                         capture_output=True, text=True, timeout=60)
    assert float(out.stdout.strip()) == float(state["a.weight"].sum())


def test_other_memory_is_not_a_segment_and_a_dropped_segment_closes_its_descriptor() -> None:
    segs = segments.Segments()
    assert segs.locate({"x": torch.ones(4)}) is None  # plain memory: the engine stages it
    buf = segs.alloc(1024)
    mixed = {"x": torch.from_numpy(buf)[:16].view(torch.float32), "y": torch.ones(4)}
    assert segs.locate(mixed) is None  # not all in one segment
    assert segs.locate({"t": torch.from_numpy(buf).view(torch.float32).view(16, 16)[:, :2]}) is None  # strided
    assert len(segs) == 1
    fd_path = segs.locate({"x": torch.from_numpy(buf)})[0]  # type: ignore[index]
    assert os.readlink(fd_path).startswith("/memfd:robustrl-weights")  # nothing in /dev/shm
    inode = os.stat(fd_path).st_ino
    del mixed, buf
    gc.collect()
    assert len(segs) == 0
    # Its descriptor is closed. The number may be taken (and dropped again) by another thread's file
    # at any moment, so ask once, by the file it names, and take "no such descriptor" as closed.
    try:
        assert os.stat(fd_path).st_ino != inode
    except FileNotFoundError:
        pass


def test_segment_is_zeroed_and_writable() -> None:
    buf = segments.Segments().alloc(mmap.PAGESIZE + 3)
    assert buf.nbytes == mmap.PAGESIZE + 3 and not buf.any()
    buf[:] = 7
    assert int(np.asarray(buf, dtype=np.int64).sum()) == 7 * buf.nbytes


# --- the worker's side: SegmentMap ----------------------------------------------------------------


def _segment(segs: Segments, nbytes: int, fill: int) -> tuple[np.ndarray, str, int]:
    buf = segs.alloc(nbytes)
    buf[:] = fill
    path = segs.locate({"b": torch.from_numpy(buf)})[0]
    return buf, path, os.stat(path).st_ino


def _mapped(ino: int) -> int:
    """How many mappings of this process are of the file with this inode (from /proc/self/maps)."""
    with open("/proc/self/maps") as f:
        return sum(1 for line in f if len(parts := line.split()) >= 5 and parts[4] == str(ino))


def test_a_prefetch_never_unmaps_the_segment_a_swap_holds() -> None:
    """The worker's swap reads the replica's segment through the mapping it holds; the replica's
    hint for the next version (a prefetch, in its own thread) arrives meanwhile. The held segment
    stays mapped with its bytes until the swap releases it; then the next one replaces it."""
    from robustrl.model.engines.segments import SegmentMap

    segs = Segments()
    n = 1 << 20
    a, path_a, ino_a = _segment(segs, n, 7)
    b, path_b, ino_b = _segment(segs, n, 9)
    sm = SegmentMap()
    held = sm.hold(path_a, n, ino_a)
    view = torch.frombuffer(held, dtype=torch.uint8)  # what a load reads (no buffer export: see SegmentMap)
    sm.prefetch(path_b, n, ino_b)
    # The window a load spends reading (a 2.4 GB model: seconds): the prefetch must wait it out.
    deadline = time.monotonic() + 0.3
    while time.monotonic() < deadline:
        assert not held.closed and int(view[::4096].min()) == 7 == int(view[::4096].max())
        time.sleep(0.01)
    assert _mapped(ino_a) == 2  # the replica's own mapping and the held one
    sm.release()
    eventually(lambda: _mapped(ino_b) == 2 and _mapped(ino_a) == 1, timeout=10, interval=0.01,
               what="the prefetched segment mapped, the released one unmapped")
    assert held.closed
    # The next swap finds the prefetched mapping (the same object, nothing mapped again).
    again = sm.hold(path_b, n, ino_b)
    assert int(torch.frombuffer(again, dtype=torch.uint8)[::4096].max()) == 9 and _mapped(ino_b) == 2
    sm.release()
    del view, a, b


def test_a_stale_hint_or_another_file_at_the_path_is_refused_and_the_kept_mapping_stays() -> None:
    from robustrl.errors import WeightSyncError
    from robustrl.model.engines.segments import SegmentMap

    segs = Segments()
    n = 1 << 16
    a, path_a, ino_a = _segment(segs, n, 3)
    sm = SegmentMap()
    sm.hold(path_a, n, ino_a)
    sm.release()
    # The replica freed a segment and its descriptor number went to another file: a hint naming
    # the freed segment's inode is refused and the kept mapping is not dropped for it.
    other, path_o, ino_o = _segment(segs, n, 4)
    sm.prefetch(path_o, n, ino_o + 1)
    with pytest.raises(WeightSyncError, match="not the replica's segment"):
        sm.hold(path_o, n, ino_o + 1)
    eventually(lambda: not sm._prefetching, timeout=10, interval=0.01, what="the hint handled")
    assert _mapped(ino_a) == 2 and _mapped(ino_o) == 1
    # A regular file is never mapped, whatever its size.
    with tempfile.NamedTemporaryFile() as f:
        f.truncate(n)
        f.flush()
        with pytest.raises(WeightSyncError, match="not a weights segment"):
            sm.hold(f.name, n, os.stat(f.name).st_ino)
    # A segment smaller than announced is refused too.
    with pytest.raises(WeightSyncError, match="not a weights segment"):
        sm.hold(path_a, 2 * n, ino_a)
    assert _mapped(ino_a) == 2  # the kept mapping survived every refusal
    del a, other

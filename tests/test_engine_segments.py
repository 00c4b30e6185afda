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

import numpy as np
import pytest
import torch

from robustrl.model.engines import segments
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

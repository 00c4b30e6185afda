"""One rank of a two-rank gloo gang resuming from a file checkpoint store (``test_checkpoint_gang``):
rank 0 scans the store first; then the newest manifest "lands" (moved back into place by rank 1,
as a stale gang's late upload would) and rank 1 scans; both then agree on a checkpoint as the
trainer does (``agree_on_checkpoint``). Prints the (step, epoch) this rank resumes from as JSON.

Usage: resume_rank.py RANK PORT STORE_DIR PREFIX HIDDEN_MANIFEST MANIFEST_PATH
"""

from __future__ import annotations

import datetime
import json
import os
import sys

import torch.distributed as dist
from robustrl.services.trainer.worker import agree_on_checkpoint

from robustrl.checkpoint import Checkpointer
from robustrl.storage.objects import FileObjectStore


def main() -> None:
    rank, port, root, prefix, hidden, manifest = sys.argv[1:7]
    rank_i = int(rank)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank_i, world_size=2,
                            timeout=datetime.timedelta(seconds=60))
    ckpt = Checkpointer(FileObjectStore(root), prefix, rank=rank_i, world_size=2, epoch=2)
    if rank_i == 0:
        state = ckpt.load_latest()
        dist.barrier()  # rank 0 has scanned
    else:
        dist.barrier()
        os.replace(hidden, manifest)  # the late manifest lands between the two scans
        state = ckpt.load_latest()
    own = None if state is None else [state.step, state.epoch]
    agreed = agree_on_checkpoint(ckpt, state, rank_i, 2)
    print(json.dumps({"rank": rank_i, "own": own,
                      "resumes": None if agreed is None else [agreed.step, agreed.epoch]}), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

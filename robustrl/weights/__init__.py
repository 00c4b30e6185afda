"""Weight sync: flat buffers + manifests, shard plans, transports, relaying multi-source pull.

Importing this package needs neither torch nor ucxx: ``manifest`` and ``plan`` are pure,
``flat`` imports torch, and the UCX transport is loaded only for ``ucx://`` addresses.
"""

from robustrl.weights.manifest import ChunkEntry, Manifest, TensorEntry, build_manifest, chunk_checksum
from robustrl.weights.puller import PullStats, Transfer, fetch_manifest, pull
from robustrl.weights.server import Fault, WeightServer

__all__ = [
    "ChunkEntry",
    "Fault",
    "Manifest",
    "PullStats",
    "TensorEntry",
    "Transfer",
    "WeightServer",
    "build_manifest",
    "chunk_checksum",
    "fetch_manifest",
    "pull",
]

"""weight_sync: the trainer's HF-named tensors into the engines' parameters, in memory.

Tensors are packed into same-dtype buckets with a manifest (names, shapes, offsets, checksums),
moved either through shared buffers (colocated: shared memory on CPU, CUDA IPC on GPU) or by
broadcast over a process group (disaggregated), verified on arrival, and loaded in place.
Colocated hand-offs (a handle + manifest per bucket) go either through a `deliver` call per
bucket or down a socket per sync (`BucketStream` / `receive_stream`).
Colocated senders and receivers are paired by (node, GPU UUID) identity (`pair_colocated`).
"""

from weight_sync.buckets import BucketPacker, Manifest, TensorEntry, unpack
from weight_sync.collective import BroadcastReceiver, BroadcastSender, ReceiveReport
from weight_sync.colocated import (
    DEFAULT_BUCKET_BYTES,
    BucketReceiver,
    ColocatedSender,
    Done,
    LoadAck,
    SyncReport,
)
from weight_sync.device_ops import DeviceOps
from weight_sync.errors import WeightSyncError
from weight_sync.group import SyncGroup
from weight_sync.identity import DeviceIdentity, device_identity, pair_colocated
from weight_sync.stream import (
    STREAM_BUCKET_BYTES,
    STREAM_NUM_BUFFERS,
    BucketStream,
    StreamAddress,
    StreamReport,
    receive_stream,
)

__all__ = [
    "BucketPacker",
    "Manifest",
    "TensorEntry",
    "unpack",
    "BroadcastReceiver",
    "BroadcastSender",
    "ReceiveReport",
    "SyncGroup",
    "DEFAULT_BUCKET_BYTES",
    "BucketReceiver",
    "ColocatedSender",
    "Done",
    "LoadAck",
    "SyncReport",
    "WeightSyncError",
    "DeviceOps",
    "DeviceIdentity",
    "device_identity",
    "pair_colocated",
    "STREAM_BUCKET_BYTES",
    "STREAM_NUM_BUFFERS",
    "BucketStream",
    "StreamAddress",
    "StreamReport",
    "receive_stream",
]

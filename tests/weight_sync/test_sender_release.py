"""`ColocatedSender.release` frees the bucket buffers (the trainer's offload: the engine gets
that memory back) and the next sync allocates them again.

References: weak references to the sender's buffers, the kernel's list of this process's
mappings (/proc/self/maps: neither the sender nor the receiver still maps a released segment),
and the checkpoints themselves (bitwise) for the syncs before and after.
"""

from __future__ import annotations

import gc
import os
import weakref
from pathlib import Path

import pytest
import torch

from rollout import Engine, EngineConfig
from rollout.weights import iter_safetensors
from weight_sync import BucketReceiver, ColocatedSender, Done

pytestmark = pytest.mark.skipif(
    not Path("/proc/self/maps").exists(), reason="reads the process's mappings from /proc"
)


def _mapped(segment: str) -> bool:
    return f"/dev/shm/{segment}" in Path("/proc/self/maps").read_text()


def test_release_frees_every_buffer_and_the_next_sync_still_loads_bitwise(two_checkpoints):
    old, new = two_checkpoints
    engine = Engine(EngineConfig(model_path=str(old)))
    receiver = BucketReceiver(engine)
    buffers, segments = [], set()

    def deliver(handle, manifest):
        buffers.append(weakref.ref(sender.allocator.buffer(handle)))
        segments.add(handle.payload[0])
        return Done(receiver.load(handle, manifest))

    sender = ColocatedSender(deliver, bucket_bytes=16 << 10)
    for checkpoint in (new, old):  # a sync, a release, then a sync with the other weights
        weights = dict(iter_safetensors(checkpoint))
        first = set(segments)
        report = sender.send(weights.items())
        receiver.commit()
        assert report.num_buckets > 2
        params = dict(engine.model.named_parameters())
        for name, tensor in weights.items():
            assert torch.equal(params[name], tensor), name
        if first:  # the second sync mapped new segments; the receiver let the released go
            assert segments - first and not any(_mapped(s) for s in first)
        assert all(_mapped(s) for s in segments - first)
        sender.release()
        gc.collect()
        assert buffers and all(ref() is None for ref in buffers)
        assert not any(os.path.exists(f"/dev/shm/{s}") for s in segments)  # unlinked
    receiver.opener.close()
    assert not any(_mapped(s) for s in segments)

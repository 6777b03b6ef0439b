"""The colocated protocol's ordering points, observed on a CPU through the device-ops seam.

On a GPU, copies are asynchronous and the two processes share a buffer that no stream orders:
the sender must finish filling a bucket before its handle leaves (fill -> sync -> send), and the
receiver must finish its copies out of a bucket before it acknowledges (copy -> sync -> ack),
since the sender refills the buffer once acknowledged.
"""

from __future__ import annotations

import re

import pytest
import torch
from device_spies import RecordingOps, TorchCalls

from weight_sync import BucketPacker, BucketReceiver, ColocatedSender, Done, LoadAck


def _weights(count: int = 12) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [(f"w{i}", torch.randn(64 + i, generator=g).to(torch.bfloat16)) for i in range(count)]


@pytest.mark.parametrize("verify", [True, False])
def test_sender_syncs_each_bucket_after_filling_it_and_before_sending_it(verify):
    """With the GPU checksum (torch copies, visible here) and with verification off (the case
    where no checksum read orders anything)."""
    log, manifests = [], []

    def deliver(handle, manifest):
        log.append("send")
        manifests.append(manifest)
        return Done(LoadAck(len(manifest.entries), manifest.nbytes, 0.0, 0.0))

    sender = ColocatedSender(
        deliver, bucket_bytes=512, verify=verify, algorithm="wsum64", ops=RecordingOps(log)
    )
    weights = _weights()
    with TorchCalls(log):
        sender.send(weights)
    sender.release()
    assert len(manifests) > 3
    order = [e for e in log if e != "host_read"]
    if verify:  # every fill of a bucket, then the sync, then the send
        assert re.fullmatch(r"(fill,)+sync,send(,(fill,)+sync,send)*", ",".join(order)), order
        fills = [part.count("fill") for part in ",".join(order).split(",sync,send")[:-1]]
        assert fills == [len(m.entries) for m in manifests]
    else:  # the native copy is invisible to torch's hook; the sync still precedes every send
        assert order == ["sync", "send"] * len(manifests)


class RecordingEngine:
    """A WeightReceiver: copies each tensor into its own parameter, logging each copy."""

    def __init__(self, log: list, weights):
        self.log = log
        self.params = {name: torch.zeros_like(t) for name, t in weights}

    def load_weights(self, named_tensors):
        for name, tensor in named_tensors:
            self.params[name].copy_(tensor)
            self.log.append("copy")

    def commit_weights(self):
        self.log.append("commit")


def test_receiver_syncs_after_its_copies_and_before_acknowledging():
    log = []
    weights = _weights()
    engine = RecordingEngine(log, weights)
    receiver = BucketReceiver(engine, ops=RecordingOps(log))
    buckets = 0
    for buffer, manifest in BucketPacker(512, algorithm="wsum64").pack(weights):
        receiver.load_buffer(buffer, manifest)
        log.append("ack")
        buckets += 1
        assert log[-len(manifest.entries) - 2 :] == ["copy"] * len(manifest.entries) + [
            "sync",
            "ack",
        ]
    receiver.commit()
    assert buckets > 3 and log.count("sync") == buckets and log[-1] == "commit"
    for name, tensor in weights:
        assert torch.equal(engine.params[name], tensor)

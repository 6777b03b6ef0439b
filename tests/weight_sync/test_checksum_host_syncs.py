"""The GPU checksum (wsum64) reads values back to the host once per bucket, not once per tensor.

Run on CPU tensors (the same torch code as on a GPU), counting every call that reads a tensor's
value back to the host (each a host sync on a GPU) with torch's function-mode hook. The values
are checked against an independent int64 implementation of the spec.
"""

from __future__ import annotations

import torch
from device_spies import RecordingOps, TorchCalls

from weight_sync import BucketReceiver, ColocatedSender, Done
from weight_sync.checksum import checksums, copy_with_checksums

_PRIME = 65521


def _wsum64_reference(tensor: torch.Tensor) -> int:
    """sum(w_i * (i mod 65521 + 1)) + sum(w_i) over the signed 16-bit words, mod 2^64."""
    words = tensor.reshape(-1).view(torch.int16).to(torch.int64)
    i = torch.arange(words.numel(), dtype=torch.int64)
    total = int((words * (i % _PRIME + 1)).sum() + words.sum())
    return (total + (1 << 63)) % (1 << 64) - (1 << 63)


def _tensors(count: int, numel: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(count)
    return [torch.randn(numel, generator=g).to(torch.bfloat16) for _ in range(count)]


def _host_reads(fn) -> tuple[int, object]:
    log = []
    with TorchCalls(log):
        out = fn()
    return log.count("host_read"), out


def test_checksums_of_a_bucket_read_the_host_once_however_many_tensors():
    for count in (2, 64):
        tensors = _tensors(count, 257)
        reads, sums = _host_reads(lambda t=tensors: checksums(t, "wsum64"))
        assert reads == 1, (count, reads)
        assert sums == [_wsum64_reference(t) for t in tensors]


def test_copying_a_bucket_with_checksums_reads_the_host_once():
    for count in (2, 64):
        tensors = _tensors(count, 100)
        buffer = torch.empty(count * 100, dtype=torch.bfloat16)
        pairs = [(buffer[k * 100 : (k + 1) * 100], t) for k, t in enumerate(tensors)]
        reads, sums = _host_reads(lambda p=pairs: copy_with_checksums(p, "wsum64"))
        assert reads == 1, (count, reads)
        assert sums == [_wsum64_reference(t) for t in tensors]
        assert torch.equal(buffer, torch.cat(tensors))


def test_wsum64_is_exact_at_the_extreme_words_and_across_chunks():
    """Words of -2^15 and 2^15 - 1 at the largest weights (the int32 products' bounds), and a
    tensor longer than one chunk of the device computation."""
    extremes = torch.tensor([-32768, 32767] * 70000, dtype=torch.int16).view(torch.bfloat16)
    long = _tensors(1, 5_000_000)[0]
    assert checksums([extremes, long], "wsum64") == [
        _wsum64_reference(extremes),
        _wsum64_reference(long),
    ]


class _Params:
    def __init__(self, weights):
        self.params = {name: torch.zeros_like(t) for name, t in weights}

    def load_weights(self, named_tensors):
        for name, tensor in named_tensors:
            self.params[name].copy_(tensor)

    def commit_weights(self):
        pass


def _sync_counts(count: int) -> tuple[int, int, int]:
    """(host reads, device syncs, buckets) of one colocated sync of `count` tensors of 4 KiB in
    total per bucket, sender and receiver together, with the GPU checksum."""
    numel = 2048 // count  # bf16: 4 KiB per bucket of `count` tensors
    weights = [(f"w{i}", t) for i, t in enumerate(_tensors(4 * count, numel))]
    syncs = []
    engine = _Params(weights)
    receiver = BucketReceiver(engine, ops=RecordingOps(syncs))
    sender = ColocatedSender(
        lambda h, m: Done(receiver.load(h, m)),
        bucket_bytes=4096,
        algorithm="wsum64",
        ops=RecordingOps(syncs),
    )
    reads, report = _host_reads(lambda: sender.send(weights))
    sender.release()
    for name, tensor in weights:
        assert torch.equal(engine.params[name], tensor)
    return reads, len(syncs), report.num_buckets


def test_host_syncs_per_weight_sync_do_not_grow_with_the_number_of_tensors():
    few, many = _sync_counts(2), _sync_counts(64)
    assert few[2] == many[2] == 4  # the same buckets, 32x the tensors
    assert few == many
    reads, syncs, buckets = many
    assert reads == 2 * buckets and syncs == 2 * buckets  # one of each per side per bucket

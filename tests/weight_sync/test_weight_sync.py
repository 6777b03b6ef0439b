"""weight_sync: buckets, checksums, and both transports into a real engine.

References: the tensors themselves (bitwise equality after unpacking and after loading), and a
fresh engine loaded from the same weights on disk (identical greedy outputs).
"""

from __future__ import annotations

import multiprocessing as mp

import pytest
import torch
import torch.distributed as dist

from rollout import Engine, EngineConfig, SamplingParams
from rollout.weights import iter_safetensors
from weight_sync import (
    BroadcastReceiver,
    BroadcastSender,
    BucketPacker,
    BucketReceiver,
    ColocatedSender,
    Done,
    SyncGroup,
    WeightSyncError,
    unpack,
)
from weight_sync.checksum import checksum

GREEDY = SamplingParams(temperature=0.0, max_new_tokens=10, ignore_eos=True)
PROMPTS = [[3, 1, 4, 1, 5, 9, 2, 6], [2, 7, 1, 8]]


def test_pack_unpack_is_bitwise_and_respects_bucket_size():
    g = torch.Generator().manual_seed(0)
    tensors = [
        (f"w{i}", torch.randn(s, generator=g).to(dt))
        for i, (s, dt) in enumerate(
            [
                ((10, 10), torch.float32),
                ((7,), torch.bfloat16),
                ((300,), torch.float32),
                ((5, 3), torch.float32),
                ((40,), torch.bfloat16),
                ((3,), torch.float32),
            ]
        )
    ]
    packer = BucketPacker(bucket_bytes=512)
    seen = {}
    for buffer, manifest in packer.pack(tensors):
        assert all(buffer.dtype == manifest.dtype for _ in manifest.entries)
        assert (
            manifest.nbytes <= 512 or len(manifest.entries) == 1
        )  # only an oversize tensor exceeds it
        for name, view in unpack(buffer, manifest):
            seen[name] = view.clone()
    assert seen.keys() == dict(tensors).keys()
    for name, tensor in tensors:
        assert seen[name].dtype == tensor.dtype and torch.equal(seen[name], tensor)


def test_checksums_catch_a_flipped_bit_and_swapped_words():
    x = torch.randn(1000)
    for algorithm in ("wxh64", "xxh3", "wsum64"):
        reference = checksum(x, algorithm)
        flipped = x.clone()
        flipped.view(torch.int32)[123] ^= 1
        swapped = x.clone()
        swapped[[10, 20]] = swapped[[20, 10]]
        assert checksum(x.clone(), algorithm) == reference
        assert checksum(flipped, algorithm) != reference
        assert checksum(swapped, algorithm) != reference


def _engine(path, **kw):
    return Engine(EngineConfig(model_path=str(path), **kw))


def test_colocated_sync_updates_engine_bitwise(two_checkpoints):
    old, new = two_checkpoints
    engine = _engine(old)
    receiver = BucketReceiver(engine)
    sender = ColocatedSender(
        lambda handle, manifest: Done(receiver.load(handle, manifest)), bucket_bytes=8 << 10
    )
    new_weights = dict(iter_safetensors(new))
    report = sender.send(new_weights.items())
    receiver.commit()
    sender.close()
    assert report.num_tensors == len(new_weights) and report.num_buckets > 2
    params = dict(engine.model.named_parameters())
    for name, tensor in new_weights.items():
        assert torch.equal(params[name], tensor), name
    assert engine.weight_version == 1
    assert engine.generate(PROMPTS, GREEDY) == _engine(new).generate(PROMPTS, GREEDY)


def test_corrupted_bucket_is_caught_and_not_loaded(two_checkpoints):
    old, new = two_checkpoints
    engine = _engine(old)
    receiver = BucketReceiver(engine)
    deliveries = []

    def corrupting_deliver(handle, manifest):
        deliveries.append(manifest)
        if len(deliveries) == 2:  # flip one byte of the second bucket's first tensor in flight
            buffer = receiver.opener.open(handle)
            buffer.view(torch.uint8)[manifest.entries[0].offset * buffer.element_size()] ^= 0xFF
        return Done(receiver.load(handle, manifest))

    sender = ColocatedSender(corrupting_deliver, bucket_bytes=8 << 10)
    with pytest.raises(WeightSyncError, match="checksum mismatch") as err:
        sender.send(iter_safetensors(new))
    assert deliveries[1].entries[0].name in str(err.value)
    sender.close()
    with pytest.raises(RuntimeError, match="commit_weights"):  # half-updated engine refuses
        engine.generate(PROMPTS, GREEDY)


@pytest.mark.parametrize("which", ["first", "middle", "last"])
def test_corrupted_tensor_anywhere_leaves_its_whole_bucket_unloaded(two_checkpoints, which):
    """One flipped bit in any tensor of a bucket (first, middle or last byte of it): the error
    names that tensor, every tensor of the bucket keeps its old value, the earlier buckets are
    in."""
    old, new = two_checkpoints
    weights = list(iter_safetensors(new))
    engine = _engine(old)
    before = {n: p.detach().clone() for n, p in engine.model.named_parameters()}
    receiver = BucketReceiver(engine)
    loaded, corrupted = [], []  # manifests delivered intact / the corrupted one

    def corrupting_deliver(handle, manifest):
        if (
            loaded and not corrupted and len(manifest.entries) >= 3
        ):  # a later bucket of several tensors
            entry = {
                "first": manifest.entries[0],
                "middle": manifest.entries[len(manifest.entries) // 2],
                "last": manifest.entries[-1],
            }[which]
            element = {"first": 0, "middle": entry.numel // 2, "last": entry.numel - 1}[which]
            buffer = receiver.opener.open(handle)
            buffer[entry.offset + element : entry.offset + element + 1].view(torch.uint8)[0] ^= 0x01
            corrupted.append((manifest, entry.name))
        else:
            loaded.append(manifest)
        return Done(receiver.load(handle, manifest))

    sender = ColocatedSender(corrupting_deliver, bucket_bytes=16 << 10)
    with pytest.raises(WeightSyncError, match="checksum mismatch") as err:
        sender.send(weights)
    sender.close()
    ((bucket, victim),) = corrupted
    assert victim in str(err.value)
    params, new_values = dict(engine.model.named_parameters()), dict(weights)
    assert any(
        not torch.equal(before[e.name], new_values[e.name]) for e in bucket.entries
    )  # not vacuous
    for e in bucket.entries:  # nothing of the corrupted bucket was loaded
        assert torch.equal(params[e.name], before[e.name]), e.name
    for e in (e for m in loaded for e in m.entries):  # the buckets before it were
        assert torch.equal(params[e.name], new_values[e.name]), e.name


def test_sender_holds_at_most_two_buckets(two_checkpoints):
    _, new = two_checkpoints
    weights = list(iter_safetensors(new))
    bucket_bytes = max(t.nbytes for _, t in weights)
    allocated = []
    sink = BucketReceiver(_engine(new))
    sender = ColocatedSender(lambda h, m: Done(sink.load(h, m)), bucket_bytes=bucket_bytes)
    real_allocate = sender.packer._allocate

    def counting(numel, dtype):
        buffer = real_allocate(numel, dtype)
        allocated.append(buffer.nbytes)
        return buffer

    sender.packer._allocate = counting
    report = sender.send(weights)
    sender.close()
    assert report.num_buckets >= 5
    assert len(allocated) == 2 and sum(allocated) <= 2 * bucket_bytes, allocated


# -- across processes ------------------------------------------------------------------------


def _colocated_receiver_process(model_dir, conn):
    torch.set_num_threads(1)
    engine = _engine(model_dir)
    receiver = BucketReceiver(engine)
    while (msg := conn.recv()) is not None:
        handle, manifest = msg
        conn.send(receiver.load(handle, manifest))
    receiver.commit()
    conn.send(
        (
            engine.generate(PROMPTS, GREEDY),
            {n: p.numpy().copy() for n, p in engine.model.named_parameters()},
        )
    )


class _PipeFuture:
    def __init__(self, conn):
        self.conn = conn

    def result(self):
        return self.conn.recv()


def test_colocated_sync_across_processes(two_checkpoints):
    old, new = two_checkpoints
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_colocated_receiver_process, args=(str(old), child))
    proc.start()
    try:

        def deliver(handle, manifest):
            parent.send((handle, manifest))
            return _PipeFuture(parent)

        sender = ColocatedSender(deliver, bucket_bytes=16 << 10)
        report = sender.send(iter_safetensors(new))
        parent.send(None)
        outputs, params = parent.recv()
        sender.close()
    finally:
        proc.join(timeout=120)
    assert proc.exitcode == 0 and report.num_buckets > 1
    for name, tensor in iter_safetensors(new):
        assert torch.equal(torch.from_numpy(params[name]), tensor), name
    assert outputs == _engine(new).generate(PROMPTS, GREEDY)


def _broadcast_process(rank, world, rendezvous, old, new, queue):
    torch.set_num_threads(1)
    # a file rendezvous: a port probed free here and bound later could be taken in between
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=world)
    try:
        if rank == 0:  # trainer source
            report = BroadcastSender(SyncGroup.default(), sources=[0], bucket_bytes=16 << 10).send(
                iter_safetensors(new)
            )
            queue.put(("sender", report.num_buckets))
        else:  # engine
            engine = _engine(old)
            report = BroadcastReceiver(engine, SyncGroup.default(), sources=[0]).receive()
            queue.put(
                (
                    "engine",
                    rank,
                    engine.generate(PROMPTS, GREEDY),
                    {n: p.numpy().copy() for n, p in engine.model.named_parameters()},
                    report.num_buckets,
                )
            )
    finally:
        dist.destroy_process_group()


def test_broadcast_sync_to_two_engines(two_checkpoints, tmp_path):
    old, new = two_checkpoints
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    world, rendezvous = 3, str(tmp_path / "rendezvous")
    procs = [
        ctx.Process(
            target=_broadcast_process, args=(r, world, rendezvous, str(old), str(new), queue)
        )
        for r in range(world)
    ]
    for p in procs:
        p.start()
    results = [queue.get(timeout=180) for _ in range(world)]
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    expected = _engine(new).generate(PROMPTS, GREEDY)
    engines = [r for r in results if r[0] == "engine"]
    sent = [r for r in results if r[0] == "sender"][0][1]
    assert len(engines) == 2 and sent > 1
    for _, _, outputs, params, received in engines:
        assert received == sent and outputs == expected
        for name, tensor in iter_safetensors(new):
            assert torch.equal(torch.from_numpy(params[name]), tensor), name

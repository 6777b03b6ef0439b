"""The colocated hand-off over a socket (`weight_sync.stream`): one start per sync, each
bucket's handle + manifest and its acknowledgement on the socket.

References: the sent tensors themselves (the engine's parameters after a sync, with torch
equality), a fresh engine loaded from the same checkpoint (greedy outputs), the parameters
before the sync (a corrupted bucket leaves every element it carried unchanged), and real peer
processes killed or stopped midway (the other side fails with a clear error, well within its
timeout or at it)."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import socket
import threading
import time

import pytest
import stream_peers
import torch

from rollout import Engine, EngineConfig, SamplingParams
from rollout.weights import iter_safetensors
from weight_sync import (
    STREAM_NUM_BUFFERS,
    BucketReceiver,
    BucketStream,
    ColocatedSender,
    WeightSyncError,
    receive_stream,
)
from weight_sync.stream import last_level_cache_bytes, stream_bucket_bytes

GREEDY = SamplingParams(temperature=0.0, max_new_tokens=10, ignore_eos=True)
PROMPTS = [[3, 1, 4, 1, 5, 9, 2, 6], [2, 7, 1, 8]]
BUCKET = 12 << 10  # the tiny model's embedding, MLP and q/o weights are split across buckets
EMBED = "model.embed_tokens.weight"


def _engine(path) -> Engine:
    return Engine(EngineConfig(model_path=str(path)))


class ReceiverThread(threading.Thread):
    """`receive_stream` on a thread of this process; its report or error kept."""

    def __init__(self, address, receiver: BucketReceiver, timeout_s: float = 60.0):
        super().__init__(daemon=True)
        self.args = (address, receiver, timeout_s)
        self.report = self.error = None

    def run(self):
        try:
            self.report = receive_stream(*self.args)
        except Exception as e:  # noqa: BLE001 -- the test asserts on it
            self.error = e


def _sync(stream, sender, receivers, weights, timeout_s: float = 60.0):
    threads = [ReceiverThread(stream.address, r, timeout_s) for r in receivers]
    for t in threads:
        t.start()
    stream.accept(len(threads), timeout_s)
    try:
        report = sender.send(weights)
        stream.finish()
    finally:
        stream.abort()
        for t in threads:
            t.join(timeout=60)
    return report, threads


# Double buffering, and the RL loop's setting (the sender up to two buckets ahead of the acks).
NUM_BUFFERS = sorted({2, STREAM_NUM_BUFFERS})


@pytest.mark.parametrize("num_buffers", NUM_BUFFERS)
def test_streamed_syncs_update_two_engines_bitwise(two_checkpoints, num_buffers):
    """Two engines fed by one sender, two syncs on the same stream (new weights, then back to the
    old): every parameter equals the sent tensor, greedy outputs match a fresh engine."""
    old, new = two_checkpoints
    engines = [_engine(old), _engine(old)]
    receivers = [BucketReceiver(e) for e in engines]
    stream = BucketStream()
    sender = ColocatedSender(
        stream.deliver, bucket_bytes=BUCKET, split_tensors=True, num_buffers=num_buffers
    )
    for version, source in enumerate([new, old], start=1):
        weights = list(iter_safetensors(source))
        report, threads = _sync(stream, sender, receivers, weights)
        assert report.num_buckets > 4 and report.nbytes == sum(t.nbytes for _, t in weights)
        for t, receiver, engine in zip(threads, receivers, engines):
            assert t.error is None
            assert t.report.num_buckets == report.num_buckets
            receiver.commit()
            assert engine.weight_version == version
            params = dict(engine.model.named_parameters())
            for name, tensor in weights:
                assert torch.equal(params[name], tensor), name
        reference = _engine(source).generate(PROMPTS, GREEDY)
        assert all(e.generate(PROMPTS, GREEDY) == reference for e in engines)
    sender.close()
    stream.close()


def test_two_senders_stream_into_one_receiver_at_once(two_checkpoints):
    """Two trainer ranks (disjoint halves of the weights, split tensors in both) streaming into
    one engine at the same time, as an engine takes every pipeline stage's stream in a sync:
    both syncs finish, and after the commit every parameter equals the sent tensor."""
    old, new = two_checkpoints
    engine = _engine(old)
    receiver = BucketReceiver(engine)
    weights = list(iter_safetensors(new))
    halves = [weights[0::2], weights[1::2]]
    streams = [BucketStream(), BucketStream()]
    senders = [
        ColocatedSender(
            s.deliver, bucket_bytes=BUCKET, split_tensors=True, num_buffers=STREAM_NUM_BUFFERS
        )
        for s in streams
    ]
    results: list = [None, None]

    def rank(k: int) -> None:
        try:
            results[k] = _sync(streams[k], senders[k], [receiver], halves[k])
        except Exception as e:  # noqa: BLE001 -- asserted below
            results[k] = e

    ranks = [threading.Thread(target=rank, args=(k,), daemon=True) for k in (0, 1)]
    for t in ranks:
        t.start()
    for t in ranks:
        t.join(timeout=120)
    for (report, (thread,)), half in zip(results, halves):
        assert thread.error is None
        assert report.num_buckets > 2 and thread.report.num_buckets == report.num_buckets
        assert report.nbytes == sum(t.nbytes for _, t in half)
    receiver.commit()  # refused if a split tensor missed a piece
    params = dict(engine.model.named_parameters())
    for name, tensor in weights:
        assert torch.equal(params[name], tensor), name
    for sender, stream in zip(senders, streams):
        sender.close()
        stream.close()


@pytest.mark.parametrize("num_buffers", NUM_BUFFERS)
def test_a_corrupted_bucket_is_refused_with_nothing_of_it_loaded(two_checkpoints, num_buffers):
    """One flipped byte in the bucket holding the embedding's second piece: the sender raises
    the receiver's checksum error naming the tensor, that bucket's elements keep their old
    values, and the engine generates nothing until a whole update is committed."""
    old, new = two_checkpoints
    weights = list(iter_safetensors(new))
    engine = _engine(old)
    before = {n: p.detach().clone() for n, p in engine.model.named_parameters()}
    stream = BucketStream()
    corrupted = []

    def corrupting_deliver(handle, manifest):
        entry = manifest.entries[0]
        if not corrupted and entry.name == EMBED and entry.start > 0:
            buffer = sender.allocator.buffer(handle)
            buffer[entry.offset + entry.numel // 2 :][:1].view(torch.uint8)[0] ^= 0x01
            corrupted.append(manifest)
        return stream.deliver(handle, manifest)

    sender = ColocatedSender(
        corrupting_deliver, bucket_bytes=BUCKET, split_tensors=True, num_buffers=num_buffers
    )
    with pytest.raises(WeightSyncError, match="checksum mismatch") as err:
        _sync(stream, sender, [BucketReceiver(engine)], weights)
    assert EMBED in str(err.value) and "refused a bucket" in str(err.value)
    (bucket,) = corrupted
    params, sent = dict(engine.model.named_parameters()), dict(weights)

    def elements(values: dict, e) -> torch.Tensor:
        return values[e.name].reshape(-1)[e.start : e.start + e.numel]

    assert any(not torch.equal(elements(before, e), elements(sent, e)) for e in bucket.entries)
    for e in bucket.entries:
        assert torch.equal(elements(params, e), elements(before, e)), (e.name, e.start)
    with pytest.raises(RuntimeError, match="commit_weights"):
        engine.generate(PROMPTS, GREEDY)
    sender.close()
    stream.close()


def _receiver_process(model_dir, stream: BucketStream, timeout_s: float):
    """A real engine in its own process, connected to `stream` (whose waits then take
    `timeout_s`)."""
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(
        target=stream_peers.engine_receiver,
        args=(str(model_dir), stream.address, 120.0, child),
    )
    proc.start()
    assert parent.poll(120.0) and parent.recv() == "ready"
    stream.accept(1, timeout_s)
    return proc


def test_a_killed_receiver_fails_the_sender_at_once(two_checkpoints):
    """The engine's process is killed after two buckets: the sender's next hand-off fails with
    a clear error long before its timeout."""
    old, new = two_checkpoints
    stream = BucketStream()
    proc = _receiver_process(old, stream, timeout_s=120.0)
    delivered = []

    def deliver(handle, manifest):
        if len(delivered) == 2:
            proc.kill()
            proc.join()
        delivered.append(manifest)
        return stream.deliver(handle, manifest)

    sender = ColocatedSender(deliver, bucket_bytes=BUCKET, split_tensors=True)
    start = time.monotonic()
    with pytest.raises(WeightSyncError, match="receiver 0 closed its connection"):
        sender.send(iter_safetensors(new))
    assert time.monotonic() - start < 30.0
    sender.close()
    stream.close()


def test_a_hung_receiver_fails_the_sender_at_its_timeout(two_checkpoints):
    """The engine's process stops (SIGSTOP) after two buckets: the sender waits for its ack
    `timeout_s`, then fails saying so."""
    old, new = two_checkpoints
    stream = BucketStream()
    proc = _receiver_process(old, stream, timeout_s=3.0)
    delivered = []

    def deliver(handle, manifest):
        if len(delivered) == 2:
            os.kill(proc.pid, signal.SIGSTOP)
        delivered.append(manifest)
        return stream.deliver(handle, manifest)

    sender = ColocatedSender(deliver, bucket_bytes=BUCKET, split_tensors=True)
    start = time.monotonic()
    try:
        with pytest.raises(WeightSyncError, match="acknowledged no bucket within 3 s"):
            sender.send(iter_safetensors(new))
        assert 2.5 < time.monotonic() - start < 30.0
    finally:
        proc.kill()
        proc.join()
        sender.close()
        stream.close()


def test_a_killed_sender_fails_the_receiver_and_its_commit(two_checkpoints):
    """The trainer's process dies right after handing over the embedding's first piece: the
    engine's receive fails at once saying so, its commit is refused naming the split tensor, and
    it generates nothing."""
    old, new = two_checkpoints
    engine = _engine(old)
    receiver = BucketReceiver(engine)
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=stream_peers.dying_sender, args=(str(new), BUCKET, child))
    proc.start()
    assert parent.poll(120.0)
    address = parent.recv()
    start = time.monotonic()
    with pytest.raises(WeightSyncError, match="the sender closed the stream after"):
        receive_stream(address, receiver, timeout_s=120.0)
    assert time.monotonic() - start < 30.0
    proc.join()
    assert proc.exitcode == -signal.SIGKILL
    with pytest.raises(WeightSyncError, match=EMBED):
        receiver.commit()
    assert engine.weight_version == 0
    with pytest.raises(RuntimeError, match="commit_weights"):
        engine.generate(PROMPTS, GREEDY)


def test_a_silent_sender_fails_the_receiver_at_its_timeout(two_checkpoints):
    """Connected, then nothing: the receiver gives up after `timeout_s`, saying so."""
    old, _ = two_checkpoints
    stream = BucketStream()
    thread = ReceiverThread(stream.address, BucketReceiver(_engine(old)), timeout_s=2.0)
    start = time.monotonic()
    thread.start()
    stream.accept(1, timeout_s=60.0)
    thread.join(timeout=60)
    assert 1.5 < time.monotonic() - start < 30.0
    assert isinstance(thread.error, WeightSyncError)
    assert "no bucket from the sender within 2 s after 0 bucket(s)" in str(thread.error)
    stream.close()


def test_only_a_receiver_with_the_token_is_accepted():
    """A local process that connects without the address's token is dropped; the wait for the
    real receivers then times out naming how many came."""
    stream = BucketStream()
    intruder = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    intruder.connect("\0" + stream.address.name)
    intruder.sendall(bytes(len(stream.address.token)))
    with pytest.raises(WeightSyncError, match="0 of 1 receivers connected within 1 s"):
        stream.accept(1, timeout_s=1.0)
    assert intruder.recv(1) == b""  # closed by the sender
    intruder.close()
    stream.close()


def _fake_caches(root, caches: list[tuple[int, str]]) -> str:
    """A sysfs cache directory with one index per (level, size text)."""
    for i, (level, size) in enumerate(caches):
        (root / f"index{i}").mkdir(parents=True)
        (root / f"index{i}" / "level").write_text(f"{level}\n")
        (root / f"index{i}" / "size").write_text(f"{size}\n")
    return str(root)


def test_stream_buckets_fit_half_the_last_level_cache(tmp_path):
    """The last-level cache read as Linux lays it out (the highest level's size, K/M suffixes),
    and the bucket: the largest power of two with three in flight in half of it, 4..16 MiB; 16
    MiB where /sys says nothing."""
    amd = _fake_caches(tmp_path / "amd", [(1, "32K"), (1, "32K"), (2, "1024K"), (3, "32768K")])
    intel = _fake_caches(tmp_path / "intel", [(1, "48K"), (2, "2M"), (3, "491520K")])
    assert last_level_cache_bytes(amd) == 32 << 20
    assert last_level_cache_bytes(intel) == 480 << 20
    assert last_level_cache_bytes(str(tmp_path / "none")) is None
    assert STREAM_NUM_BUFFERS == 3  # the sizes below assume three in flight
    expected = {1: 4, 24: 4, 32: 4, 47: 4, 48: 8, 95: 8, 96: 16, 480: 16}  # cache MiB -> bucket
    for cache_mib, bucket_mib in expected.items():
        assert stream_bucket_bytes(cache_mib << 20) == bucket_mib << 20
    assert stream_bucket_bytes(None) == 16 << 20

"""Two trainer ranks streaming to the same two engine actors at once (`weight_sync.stream`
into real `EngineWorker`s on Ray): the engines' calls arrive in opposite rank order.

Each streaming rank starts one `receive_stream` call on every engine it feeds and waits until
all of them have connected (`BucketStream.accept`). If an engine took those calls one at a
time, engine A serving rank 0 and engine B serving rank 1 would each hold the other rank's call
back: both ranks wait for the engine the other holds, until the timeout (seen in CI as the
PP = 2 loop test hanging). Here that order is forced: each engine's first call is running (its
rank's stream counts it connected) before its second is sent. Both syncs must finish well
within the timeout, and the engines then hold both ranks' tensors bitwise (reference: a fresh
engine loaded from the new checkpoint, compared by parameter digests)."""

from __future__ import annotations

import threading
import time

import pytest
import ray
import shared_ray
import torch

from miles_like.run.engine_inspection import parameter_digests
from rollout import Engine, EngineConfig
from rollout.weights import iter_safetensors
from weight_sync import STREAM_BUCKET_BYTES, STREAM_NUM_BUFFERS, BucketStream, ColocatedSender

pytestmark = pytest.mark.slow

BUCKET = 12 << 10  # the tiny model in many buckets, some tensors split across them
# short: the deadlock shows as both ranks' `accept` timing out; a working sync of this tiny
# model connects in well under a second, so this only has to absorb the box's load
TIMEOUT_S = 20.0


class RankSender(threading.Thread):
    """One trainer rank's side: its own stream, `accept` both engines, send its tensors."""

    def __init__(self, tensors: list):
        super().__init__(daemon=True)
        self.tensors = tensors
        self.stream = BucketStream()
        self.sender = ColocatedSender(  # as the RL loop's streaming rank, in smaller buckets
            self.stream.deliver,
            bucket_bytes=min(BUCKET, STREAM_BUCKET_BYTES),
            split_tensors=True,
            num_buffers=STREAM_NUM_BUFFERS,
        )
        self.buckets = 0
        self.error: BaseException | None = None

    def run(self):
        try:
            self.stream.accept(2, TIMEOUT_S)
            self.buckets = self.sender.send(self.tensors).num_buckets
            self.stream.finish()
        except BaseException as e:  # noqa: BLE001 -- the test asserts on it
            self.stream.abort()
            self.error = e

    def close(self):
        self.sender.close()
        self.stream.close()


def _wait_connected(rank: RankSender, count: int) -> None:
    deadline = time.monotonic() + TIMEOUT_S
    while rank.stream.connected < count:
        assert rank.is_alive() and time.monotonic() < deadline, "an engine never connected"
        time.sleep(0.01)


def test_engines_take_two_ranks_streams_called_in_opposite_orders(two_checkpoints):
    from miles_like.run.engine_worker import EngineWorker

    old, new = two_checkpoints
    shared_ray.start(2)
    cfg = EngineConfig(model_path=str(old), kv_cache_tokens=256)
    engines = [EngineWorker.options(num_cpus=0).remote(cfg, 1) for _ in range(2)]
    ray.get([e.ready.remote() for e in engines], timeout=120)

    # two "pipeline stages": disjoint halves of the new weights, one rank each
    tensors = list(iter_safetensors(str(new)))
    ranks = [RankSender(tensors[0::2]), RankSender(tensors[1::2])]
    for r in ranks:
        r.start()
    address = [r.stream.address for r in ranks]
    calls = []
    try:
        # engine k's first call is rank k's; once both run, each engine gets the other rank's
        for k, engine in enumerate(engines):
            calls.append(engine.receive_stream.remote(address[k], False, TIMEOUT_S))
        for r in ranks:
            _wait_connected(r, 1)
        for k, engine in enumerate(engines):
            calls.append(engine.receive_stream.remote(address[1 - k], False, TIMEOUT_S))
        for r in ranks:
            r.join(3 * TIMEOUT_S)
        assert [r.error for r in ranks] == [None, None]
        reports = ray.get(calls, timeout=TIMEOUT_S)
    finally:
        for r in ranks:
            r.join(3 * TIMEOUT_S)
            r.close()
        if len(calls) < 4 or any(r.error is not None for r in ranks):
            for engine in engines:  # a failed sync's calls may still wait on their sockets
                ray.kill(engine)
    # each engine took every bucket of both ranks
    assert [x["num_buckets"] for x in reports] == [ranks[k].buckets for k in (0, 1, 1, 0)]
    assert all(r.buckets > 1 for r in ranks)
    ray.get([e.commit.remote() for e in engines], timeout=60)

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        want = parameter_digests(Engine(EngineConfig(model_path=str(new))).model)
    finally:
        torch.set_num_threads(threads)
    for engine in engines:
        assert ray.get(engine.weight_digests.remote(), timeout=60) == want
    for engine in engines:
        ray.kill(engine)

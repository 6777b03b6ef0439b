"""The far ends of `weight_sync.stream` for tests/weight_sync/test_stream.py, each run in a
process of its own so that a test can kill or stop it."""

from __future__ import annotations

import os
import signal

import torch

from rollout import Engine, EngineConfig
from rollout.weights import iter_safetensors
from weight_sync import BucketReceiver, BucketStream, ColocatedSender, receive_stream


def engine_receiver(model_dir: str, address, timeout_s: float, conn) -> None:
    """A real engine taking one streamed sync (killed or stopped by the test midway); says
    "ready" on `conn` once built, before it connects."""
    torch.set_num_threads(1)
    engine = Engine(EngineConfig(model_path=model_dir))
    conn.send("ready")
    receive_stream(address, BucketReceiver(engine), timeout_s)


def dying_sender(model_dir: str, bucket_bytes: int, conn) -> None:
    """Streams `model_dir`'s weights and dies (SIGKILL) right after handing over the bucket
    that holds the embedding's first piece: the receiver has part of a split tensor."""
    torch.set_num_threads(1)
    stream = BucketStream()
    conn.send(stream.address)
    stream.accept(1, timeout_s=60.0)

    def deliver(handle, manifest):
        acks = stream.deliver(handle, manifest)
        if any(e.name == "model.embed_tokens.weight" and not e.whole for e in manifest.entries):
            os.kill(os.getpid(), signal.SIGKILL)
        return acks

    ColocatedSender(deliver, bucket_bytes=bucket_bytes, split_tensors=True).send(
        iter_safetensors(model_dir)
    )

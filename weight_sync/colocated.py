"""Colocated weight sync: trainer and engine share a host (and, on GPU, a device).

The sender packs the trainer's exported (hf_name, tensor) stream into two shared buffers
(double buffering) and hands each bucket to the receiver as a handle + manifest; only those are
pickled. The receiver verifies the bucket's checksums, copies its tensors into the engine's
parameters in place, and acknowledges; only then may the sender refill that buffer. While the
receiver loads bucket k the sender packs bucket k+1.

`deliver(handle, manifest)` is the one seam between the two: it must start the receiver's
`load` (in another process, an actor call, or directly) and return something with `.result()`
that yields the receiver's `LoadAck`.

Ordering across the two processes (`device_ops`): the sender's fill of a bucket has finished
before its handle leaves, and the receiver's copies out of it have finished before its ack. A
handle only reaches a receiver on the sender's own GPU (`identity.pair_colocated`; the opener
refuses any other). `release` frees the sender's buffers (the trainer's offload, so that the
engine gets that memory back); the next `send` allocates them again.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from typing import NamedTuple, Protocol

import torch

from weight_sync.buckets import BucketPacker, Manifest, corrupted_tensors, pieces, unpack
from weight_sync.device_ops import DeviceOps
from weight_sync.errors import WeightSyncError
from weight_sync.pieces import SplitTensors
from weight_sync.quantize import check_quantization, quantized_stream
from weight_sync.shared_buffers import BufferHandle, BufferOpener, SharedBufferAllocator

DEFAULT_BUCKET_BYTES = 512 << 20


class LoadAck(NamedTuple):
    num_tensors: int
    nbytes: int
    verify_s: float
    load_s: float


class SyncReport(NamedTuple):
    num_buckets: int
    num_tensors: int
    nbytes: int
    export_s: float  # pulling tensors from the trainer's exporter (TP gather + HF conversion)
    pack_s: float  # copying into buckets + sender checksums
    transfer_s: float  # waiting on the receivers, less their verify and load time
    verify_s: float  # receiver-side checksums
    load_s: float  # receiver-side copies into the engine's parameters
    total_s: float


class Future(Protocol):
    def result(self) -> LoadAck: ...


class Done:
    """An already-completed delivery (in-process receivers)."""

    def __init__(self, ack: LoadAck):
        self._ack = ack

    def result(self) -> LoadAck:
        return self._ack


class WeightReceiver(Protocol):
    """What the receiver needs from an engine: partial in-place loads, then one commit."""

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None: ...
    def commit_weights(self) -> None: ...


def timed_iteration(iterator: Iterator, clock: list[float]) -> Iterator:
    """Yield from `iterator`, adding the time spent inside it to clock[0]."""
    while True:
        start = time.perf_counter()
        try:
            item = next(iterator)
        except StopIteration:
            clock[0] += time.perf_counter() - start
            return
        clock[0] += time.perf_counter() - start
        yield item


class ColocatedSender:
    def __init__(
        self,
        deliver: Callable[[BufferHandle, Manifest], Future],
        *,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        device: torch.device | str = "cpu",
        verify: bool = True,
        algorithm: str | None = None,
        ops: DeviceOps | None = None,
        quantization: str | None = None,
        num_buffers: int = 2,
        split_tensors: bool = False,
    ):
        """`quantization` ("fp8" or None): the form the engines hold their linear weights in,
        which the sender quantizes them to as they stream past (`weight_sync.quantize`).
        `num_buffers`: buckets in flight at once (2: double buffering). `split_tensors`: cut
        tensors larger than a bucket into pieces (`BucketPacker`), so that every bucket is at
        most `bucket_bytes`."""
        check_quantization(quantization)
        if num_buffers < 2:
            raise ValueError(f"num_buffers={num_buffers}: at least 2 (fill one, send another)")
        self.quantization = quantization
        self.num_buffers = num_buffers
        self.allocator = SharedBufferAllocator(device)
        self.packer = BucketPacker(
            bucket_bytes,
            device,
            num_buffers=num_buffers,
            allocator=self.allocator,
            verify=verify,
            algorithm=algorithm,
            split_tensors=split_tensors,
        )
        self.deliver = deliver
        self.ops = ops or DeviceOps()

    def send(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> SyncReport:
        start = time.perf_counter()
        export_clock = [0.0]
        in_flight: deque[Future] = deque()
        acks: list[LoadAck] = []
        buckets = 0
        pack_s = wait_s = 0.0
        # export_s includes the sender's quantization, if any (it runs as the stream is pulled)
        stream = timed_iteration(quantized_stream(named_tensors, self.quantization), export_clock)
        packed = self.packer.pack(stream)
        while True:
            # The packer is about to reuse the buffer of the bucket sent `num_buffers`
            # deliveries ago (same dtype): its ack must be in first. Waiting on the oldest
            # suffices.
            if len(in_flight) >= self.num_buffers:
                t = time.perf_counter()
                acks.append(in_flight.popleft().result())
                wait_s += time.perf_counter() - t
            t0, e0 = time.perf_counter(), export_clock[0]
            item = next(packed, None)
            pack_s += (time.perf_counter() - t0) - (export_clock[0] - e0)
            if item is None:
                break
            buffer, manifest = item
            self.ops.synchronize(buffer.device)  # the fill is done before the handle leaves
            in_flight.append(self.deliver(self.allocator.handle(buffer), manifest))
            buckets += 1
        t = time.perf_counter()
        acks.extend(f.result() for f in in_flight)
        wait_s += time.perf_counter() - t
        verify_s = sum(a.verify_s for a in acks)
        load_s = sum(a.load_s for a in acks)
        return SyncReport(
            buckets,
            sum(a.num_tensors for a in acks),
            sum(a.nbytes for a in acks),
            export_clock[0],
            pack_s,
            max(0.0, wait_s - verify_s - load_s),
            verify_s,
            load_s,
            time.perf_counter() - start,
        )

    def release(self) -> None:
        """Free the bucket buffers (between syncs: every delivery has been acknowledged). The
        next `send` allocates them again."""
        self.packer.release()  # drop the packer's views before the allocator frees them
        self.allocator.release()

    close = release


class BucketReceiver:
    """Engine side of both transports: verify a bucket, load it in place, acknowledge.

    Several senders may feed one receiver at once (the streams of several trainer ranks,
    `weight_sync.stream`, each loading its own tensors): their buckets load one at a time, a
    bucket's verify and load as one step under `_lock`, so the engine and the split-tensor
    bookkeeping see one bucket's calls at a time. The lock is held only while a bucket is
    verified and copied, never while waiting for a sender, so no stream waits on another's
    sender."""

    def __init__(
        self,
        engine: WeightReceiver,
        verify: bool = True,
        opener: BufferOpener | None = None,
        ops: DeviceOps | None = None,
    ):
        self.engine = engine
        self.verify = verify
        self.opener = opener or BufferOpener()
        self.ops = ops or DeviceOps()
        self.split = SplitTensors(engine)  # pieces of tensors split across buckets
        self._lock = threading.Lock()

    def load_buffer(self, buffer: torch.Tensor, manifest: Manifest) -> LoadAck:
        with self._lock:
            return self._load_buffer(buffer, manifest)

    def _load_buffer(self, buffer: torch.Tensor, manifest: Manifest) -> LoadAck:
        t0 = time.perf_counter()
        if self.verify and manifest.checksum_algorithm != "none":
            bad = corrupted_tensors(buffer, manifest)
            if bad:
                raise WeightSyncError(
                    f"weight sync checksum mismatch in {len(bad)} tensor(s): {bad[:8]}; "
                    "the bucket was not loaded"
                )
        t1 = time.perf_counter()
        if any(e.whole for e in manifest.entries) or not manifest.entries:
            self.engine.load_weights(unpack(buffer, manifest))
        for entry, piece in pieces(buffer, manifest):
            self.split.load(entry, piece)
        self.ops.synchronize(buffer.device)  # the copies are done before the ack
        t2 = time.perf_counter()
        return LoadAck(len(manifest.entries), manifest.nbytes, t1 - t0, t2 - t1)

    def load(self, handle: BufferHandle, manifest: Manifest) -> LoadAck:
        """Map the sender's buffer, verify, load, acknowledge. A CUDA buffer's mapping is
        dropped on return (after the copies finished), so the sender's `release` frees it."""
        with self._lock:
            return self._load_buffer(self.opener.open(handle), manifest)

    def commit(self) -> None:
        with self._lock:
            incomplete = self.split.incomplete()
            self.split.reset()
            if incomplete:
                raise WeightSyncError(
                    f"weight sync ended with split tensors missing pieces: {incomplete[:8]}; "
                    "the update is not committed (the engine serves nothing until a whole one "
                    "is)"
                )
            self.engine.commit_weights()

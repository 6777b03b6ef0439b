"""Collective weight sync: trainer source ranks broadcast buckets to engine ranks over a
`SyncGroup` (NCCL on GPU, gloo on CPU). For disaggregated placement, where trainer and engines
do not share memory.

Protocol, per source in `sources` order (one source per pipeline stage, each holding its stage's
layers): the source broadcasts a manifest, then the bucket's bytes; a `None` manifest ends that
source's stream. Every member of the group takes part in every broadcast (the other sources just
receive and drop), so any number of engines receive each bucket once.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import NamedTuple

import torch

from weight_sync.buckets import BucketPacker, Manifest
from weight_sync.colocated import (
    DEFAULT_BUCKET_BYTES,
    BucketReceiver,
    SyncReport,
    WeightReceiver,
    timed_iteration,
)
from weight_sync.group import SyncGroup


class ReceiveReport(NamedTuple):
    num_buckets: int
    nbytes: int
    transfer_s: float
    verify_s: float
    load_s: float
    total_s: float


def _broadcast_manifest(manifest: Manifest | None, src: int, group: SyncGroup) -> Manifest | None:
    return group.broadcast_object(manifest, src)


class BroadcastSender:
    def __init__(
        self,
        group: SyncGroup,
        sources: list[int],
        *,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        verify: bool = True,
    ):
        self.group, self.sources = group, list(sources)
        self.rank = group.rank
        if self.rank not in self.sources:
            raise ValueError(f"sync-group rank {self.rank} is not among the sources {self.sources}")
        self.device = group.device
        self.packer = BucketPacker(bucket_bytes, self.device, num_buffers=2, verify=verify)
        self._receive_buffers: dict[torch.dtype, torch.Tensor] = {}

    def send(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> SyncReport:
        """Broadcast this source's tensors; other sources' streams pass through (and are
        dropped)."""
        start = time.perf_counter()
        export_clock = [0.0]
        pack_s = transfer_s = 0.0
        buckets = tensors = nbytes = 0
        for src in self.sources:
            if src != self.rank:
                _drain(src, self.group, self._receive_buffers, self.device)
                continue
            packed = self.packer.pack(timed_iteration(iter(named_tensors), export_clock))
            while True:
                t0, e0 = time.perf_counter(), export_clock[0]
                item = next(packed, None)
                pack_s += (time.perf_counter() - t0) - (export_clock[0] - e0)
                t = time.perf_counter()
                if item is None:
                    _broadcast_manifest(None, src, self.group)
                    transfer_s += time.perf_counter() - t
                    break
                buffer, manifest = item
                _broadcast_manifest(manifest, src, self.group)
                self.group.broadcast(buffer[: manifest.numel], src)
                transfer_s += time.perf_counter() - t
                buckets += 1
                tensors += len(manifest.entries)
                nbytes += manifest.nbytes
        return SyncReport(
            buckets,
            tensors,
            nbytes,
            export_clock[0],
            pack_s,
            transfer_s,
            0.0,
            0.0,
            time.perf_counter() - start,
        )


def _receive_into(
    buffers: dict[torch.dtype, torch.Tensor],
    manifest: Manifest,
    src: int,
    group: SyncGroup,
    device: torch.device,
) -> torch.Tensor:
    buffer = buffers.get(manifest.dtype)
    if buffer is None or buffer.numel() < manifest.numel:
        buffer = buffers[manifest.dtype] = torch.empty(
            manifest.numel, dtype=manifest.dtype, device=device
        )
    region = buffer[: manifest.numel]
    group.broadcast(region, src)
    return region


def _drain(src: int, group, buffers, device) -> None:
    while (manifest := _broadcast_manifest(None, src, group)) is not None:
        _receive_into(buffers, manifest, src, group, device)


class BroadcastReceiver:
    """Engine rank: receive every source's buckets, verify, load in place, then commit once."""

    def __init__(
        self, engine: WeightReceiver, group: SyncGroup, sources: list[int], *, verify: bool = True
    ):
        self.group, self.sources = group, list(sources)
        self.device = group.device
        self.receiver = BucketReceiver(engine, verify=verify)
        self._buffers: dict[torch.dtype, torch.Tensor] = {}

    def receive(self) -> ReceiveReport:
        start = time.perf_counter()
        buckets = nbytes = 0
        transfer_s = verify_s = load_s = 0.0
        for src in self.sources:
            while True:
                t = time.perf_counter()
                manifest = _broadcast_manifest(None, src, self.group)
                if manifest is None:
                    transfer_s += time.perf_counter() - t
                    break
                region = _receive_into(self._buffers, manifest, src, self.group, self.device)
                transfer_s += time.perf_counter() - t
                ack = self.receiver.load_buffer(region, manifest)
                verify_s += ack.verify_s
                load_s += ack.load_s
                buckets += 1
                nbytes += ack.nbytes
        self.receiver.commit()
        return ReceiveReport(
            buckets, nbytes, transfer_s, verify_s, load_s, time.perf_counter() - start
        )

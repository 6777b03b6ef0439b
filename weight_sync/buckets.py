"""Buckets: many HF-named tensors of one dtype flattened into one buffer, plus a manifest.

A bucket is the unit of transfer and of verification. Its manifest lists each tensor's name,
shape, offset and checksum, so a receiver can rebuild views without copying and name exactly
which tensors arrived corrupted.

With `split_tensors`, a tensor larger than a bucket is cut into pieces that fill whole buckets
(each piece a range of its flattened elements, `TensorEntry.start`), so no bucket exceeds
`bucket_bytes`: buckets the size of the last-level cache then let a receiver verify a bucket and
copy it out while it is still in cache (`weight_sync.pieces` loads the pieces).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator
from typing import NamedTuple

import torch

from weight_sync.checksum import algorithm_for, checksums, copy_with_checksums


class TensorEntry(NamedTuple):
    name: str
    shape: tuple[int, ...]  # the whole tensor's, also for a piece of it
    offset: int  # in elements of the bucket's dtype
    numel: int  # elements in this bucket
    checksum: int
    start: int = 0  # a piece: its first element in the flattened tensor

    @property
    def whole(self) -> bool:
        """The entry holds its whole tensor (not a piece of a split one)."""
        return self.start == 0 and self.numel == math.prod(self.shape)


class Manifest(NamedTuple):
    dtype: torch.dtype
    numel: int  # elements used in the buffer
    entries: tuple[TensorEntry, ...]
    checksum_algorithm: str  # see weight_sync.checksum

    @property
    def nbytes(self) -> int:
        return self.numel * torch.empty((), dtype=self.dtype).element_size()


def unpack(buffer: torch.Tensor, manifest: Manifest) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, view) pairs over `buffer` (no copies), for the entries holding whole tensors."""
    for e in manifest.entries:
        if e.whole:
            yield e.name, buffer[e.offset : e.offset + e.numel].view(e.shape)


def pieces(buffer: torch.Tensor, manifest: Manifest) -> Iterator[tuple[TensorEntry, torch.Tensor]]:
    """(entry, 1-D view) pairs over `buffer` for the pieces of split tensors (no copies)."""
    for e in manifest.entries:
        if not e.whole:
            yield e, buffer[e.offset : e.offset + e.numel]


def corrupted_tensors(buffer: torch.Tensor, manifest: Manifest) -> list[str]:
    """Names of the tensors whose checksum in `buffer` differs from the manifest's."""
    found = checksums(
        [buffer[e.offset : e.offset + e.numel] for e in manifest.entries],
        manifest.checksum_algorithm,
    )
    return [e.name for e, value in zip(manifest.entries, found) if value != e.checksum]


class BucketPacker:
    """Packs a stream of tensors into reusable buffers of `bucket_bytes`, one dtype per bucket.

    Only `num_buffers` buffers per dtype exist; `pack` yields (buffer, manifest) and the caller
    must be done with a buffer (the receiver has acknowledged it) before the packer cycles back to
    it. With two buffers that is double buffering: fill one while the other is in flight, so a
    producer holds at most two buckets of extra memory (per dtype in use).

    `split_tensors`: a tensor larger than `bucket_bytes` is cut into pieces (see the module
    docstring) instead of getting a buffer of its own size; receivers must then load pieces
    (`BucketReceiver` does).
    """

    def __init__(
        self,
        bucket_bytes: int,
        device: torch.device | str = "cpu",
        num_buffers: int = 2,
        allocator=None,
        verify: bool = True,
        algorithm: str | None = None,
        split_tensors: bool = False,
    ):
        self.verify = verify
        self.split_tensors = split_tensors
        self.algorithm = algorithm  # None: by the buffer's device (checksum.algorithm_for)
        if bucket_bytes <= 0:
            raise ValueError(f"bucket_bytes={bucket_bytes}: must be positive")
        self.bucket_bytes = bucket_bytes
        self.device = torch.device(device)
        self.num_buffers = num_buffers
        # allocator(numel, dtype) -> 1-D tensor; transports pass one that allocates shared memory.
        self._allocate = allocator or (
            lambda numel, dtype: torch.empty(numel, dtype=dtype, device=self.device)
        )
        self._buffers: dict[torch.dtype, list[torch.Tensor]] = {}
        self._next: dict[torch.dtype, int] = {}

    def _buffer(self, dtype: torch.dtype, numel: int) -> torch.Tensor:
        """The next buffer of `dtype` in the cycle, grown if a single tensor needs more room."""
        buffers = self._buffers.setdefault(dtype, [])
        index = self._next.get(dtype, 0)
        self._next[dtype] = (index + 1) % self.num_buffers
        if index == len(buffers):
            buffers.append(self._allocate(numel, dtype))
        elif buffers[index].numel() < numel:
            buffers[index] = self._allocate(numel, dtype)
        return buffers[index]

    def release(self) -> None:
        """Drop every buffer (the allocator frees them); the next `pack` allocates afresh."""
        self._buffers.clear()
        self._next.clear()

    def pack(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]]
    ) -> Iterator[tuple[torch.Tensor, Manifest]]:
        # per dtype: the (name, whole shape, first element, flat elements) waiting for a bucket
        pending: dict[torch.dtype, list[_Item]] = {}
        pending_bytes: dict[torch.dtype, int] = {}
        for name, tensor in named_tensors:
            dtype = tensor.dtype
            if pending.get(dtype) and pending_bytes[dtype] + tensor.nbytes > self.bucket_bytes:
                yield self._fill(dtype, pending.pop(dtype))
                pending_bytes[dtype] = 0
            shape = tuple(tensor.shape)
            if self.split_tensors and tensor.nbytes > self.bucket_bytes:
                # whole buckets of pieces; the last piece waits for the tensors after it
                flat = tensor.reshape(-1)
                per_bucket = max(1, self.bucket_bytes // tensor.element_size())
                start = 0
                while flat.numel() - start > per_bucket:
                    piece = flat[start : start + per_bucket]
                    yield self._fill(dtype, [_Item(name, shape, start, piece)])
                    start += per_bucket
                item = _Item(name, shape, start, flat[start:])
            else:
                item = _Item(name, shape, 0, tensor)
            pending.setdefault(dtype, []).append(item)
            pending_bytes[dtype] = pending_bytes.get(dtype, 0) + item.elements.nbytes
        for dtype, items in pending.items():
            if items:
                yield self._fill(dtype, items)

    def _fill(self, dtype: torch.dtype, items: list[_Item]) -> tuple[torch.Tensor, Manifest]:
        element = torch.empty((), dtype=dtype).element_size()
        total = sum(item.elements.numel() for item in items)
        buffer = self._buffer(dtype, max(total, self.bucket_bytes // element))
        algorithm = (self.algorithm or algorithm_for(buffer)) if self.verify else "none"
        pairs, offsets, offset = [], [], 0
        for item in items:
            numel = item.elements.numel()
            pairs.append((buffer[offset : offset + numel], item.elements))
            offsets.append(offset)
            offset += numel
        # Checksums of the bucket's bytes as written (on CPU: computed while copying, in one pass).
        sums = copy_with_checksums(pairs, algorithm)
        entries = tuple(
            TensorEntry(item.name, item.shape, at, item.elements.numel(), value, item.start)
            for item, at, value in zip(items, offsets, sums)
        )
        return buffer, Manifest(dtype, offset, entries, algorithm)


class _Item(NamedTuple):
    """A tensor, or a piece of one, waiting for its bucket."""

    name: str
    shape: tuple[int, ...]  # the whole tensor's
    start: int  # first element of `elements` in the flattened tensor
    elements: torch.Tensor  # the whole tensor, or a 1-D range of its elements

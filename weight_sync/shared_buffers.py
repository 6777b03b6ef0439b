"""Buffers another process on the same host can map without copying: the colocated transport.

* CPU: POSIX shared memory (`multiprocessing.shared_memory`); the handle is the segment's name,
  a plain string that crosses any channel (pipes, Ray calls).
* CUDA: the buffer's CUDA IPC handle, via torch's own tensor reduction; the receiver rebuilds a
  tensor over the same device memory. The handle names its GPU by UUID (`identity`), and the
  receiver maps it on whichever of its own device indices has that UUID, or refuses it.

Either way only the handle and the manifest are pickled, never the bytes.

A CUDA handle is made afresh for every delivery, after the bucket is filled: torch counts one
consumer per share (it frees the sender's memory once that consumer lets go) and records the IPC
event the consumer waits on at share time. The receiver maps a CUDA buffer for one bucket and
drops it after loading; a kept mapping would keep the sender's memory alive after `release`.
"""

from __future__ import annotations

import mmap
import os
from collections.abc import Callable
from multiprocessing import shared_memory
from typing import Any, NamedTuple

import torch

from weight_sync.errors import WeightSyncError
from weight_sync.identity import CPU, device_uuid, visible_gpus

# torch.multiprocessing.reductions.rebuild_cuda_tensor's arguments: the device index is the
# seventh (it is the sender's index; the receiver substitutes its own for the same GPU).
_REBUILD_DEVICE_ARG = 6


class BufferHandle(NamedTuple):
    kind: str  # "shm" | "cuda_ipc"
    payload: Any  # shm: (name, numel, dtype); cuda_ipc: torch's (rebuild_fn, args)
    device: str = CPU  # the UUID of the GPU holding the buffer, or "cpu"


class SharedBufferAllocator:
    """Allocates the sender's bucket buffers in memory the receiver can open; keeps them alive
    until `release`."""

    def __init__(self, device: torch.device | str = "cpu"):
        self.device = torch.device(device)
        self._segments: dict[int, shared_memory.SharedMemory] = {}
        self._handles: dict[int, BufferHandle] = {}
        self._buffers: dict[int, torch.Tensor] = {}

    def __call__(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        if self.device.type == "cuda":
            buffer = torch.empty(numel, dtype=dtype, device=self.device)
            self._buffers[buffer.data_ptr()] = buffer
            return buffer
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        segment = shared_memory.SharedMemory(create=True, size=max(nbytes, 1))
        buffer = torch.frombuffer(segment.buf, dtype=dtype, count=numel)
        self._segments[buffer.data_ptr()] = segment
        self._handles[buffer.data_ptr()] = BufferHandle("shm", (segment.name, numel, dtype))
        self._buffers[buffer.data_ptr()] = buffer
        return buffer

    def handle(self, buffer: torch.Tensor) -> BufferHandle:
        """The handle to send for `buffer`, once it holds the bucket (fresh for CUDA, see above)."""
        ptr = buffer.data_ptr()
        if ptr not in self._buffers:
            raise KeyError("not a buffer of this allocator")
        if self.device.type == "cuda":
            from torch.multiprocessing.reductions import reduce_tensor

            rebuild, args = reduce_tensor(self._buffers[ptr])
            if args[_REBUILD_DEVICE_ARG] != buffer.device.index:  # torch changed its layout
                raise RuntimeError(f"unexpected CUDA IPC arguments from torch: {args!r}")
            self._handles[ptr] = BufferHandle(
                "cuda_ipc", (rebuild, args), device_uuid(buffer.device)
            )
        return self._handles[ptr]

    def buffer(self, handle: BufferHandle) -> torch.Tensor:
        """The sender's own view of a handle it gave out (for receivers that cannot map it:
        another node gets the bytes instead)."""
        for ptr, h in self._handles.items():
            if h is handle:
                return self._buffers[ptr]
        raise KeyError("not a handle of this allocator")

    def release(self) -> None:
        """Free every buffer: unlink the segments (receivers that still map one keep their
        mapping until they let go), return CUDA memory to the device. The caller must hold no
        view of them; the allocator stays usable."""
        self._handles.clear()
        self._buffers.clear()
        for segment in self._segments.values():
            segment.unlink()
            try:
                segment.close()
            except BufferError:  # a tensor still views it; the mapping goes with the process
                pass
        self._segments.clear()
        if self.device.type == "cuda":
            torch.cuda.ipc_collect()  # blocks whose receivers have let go
            torch.cuda.empty_cache()

    close = release


def _attach(name: str, flags: int) -> int:
    import _posixshmem

    return _posixshmem.shm_open("/" + name.lstrip("/"), flags, mode=0o600)


class BufferOpener:
    """Receiver side: maps handles to tensors.

    Shared-memory segments are mapped once per segment (senders reuse their buffers) and directly
    (shm_open + mmap) rather than through `SharedMemory`, whose resource tracker would claim the
    creator's segment in this process. A segment the sender has unlinked (`release`) is unmapped
    here when the next new segment arrives. CUDA buffers are mapped per bucket (see above), on the
    local device that has the handle's GPU UUID.

    `gpus` returns UUID -> local index for the GPUs this process sees (`identity.visible_gpus`);
    it is a parameter so a test on a CPU can stand in for a GPU."""

    def __init__(self, gpus: Callable[[], dict[str, int]] = visible_gpus):
        self._open: dict[str, tuple[torch.Tensor, mmap.mmap]] = {}
        self._gpus = gpus
        self._visible: dict[str, int] | None = None

    def open(self, handle: BufferHandle) -> torch.Tensor:
        if handle.kind == "shm":
            return self._open_shm(*handle.payload)
        if handle.kind == "cuda_ipc":
            if self._visible is None:
                self._visible = self._gpus()
            index = self._visible.get(handle.device)
            if index is None:
                raise WeightSyncError(
                    f"a CUDA IPC weight buffer on GPU {handle.device} reached a process that does "
                    f"not see that GPU (it sees {sorted(self._visible) or 'no GPU'}); colocated "
                    "sync must pair each engine with the trainer rank on its own GPU "
                    "(weight_sync.pair_colocated)"
                )
            rebuild, args = handle.payload
            args = (*args[:_REBUILD_DEVICE_ARG], index, *args[_REBUILD_DEVICE_ARG + 1 :])
            return rebuild(*args)
        raise ValueError(f"unknown buffer handle kind {handle.kind!r}")

    def _open_shm(self, name: str, numel: int, dtype: torch.dtype) -> torch.Tensor:
        if name not in self._open:
            self._drop_unlinked()
            fd = _attach(name, os.O_RDWR)
            try:
                mapping = mmap.mmap(fd, os.fstat(fd).st_size)
            finally:
                os.close(fd)
            self._open[name] = (torch.frombuffer(mapping, dtype=dtype, count=numel), mapping)
        return self._open[name][0]

    def _drop_unlinked(self) -> None:
        for name in list(self._open):
            try:
                os.close(_attach(name, os.O_RDONLY))
            except FileNotFoundError:
                tensor, mapping = self._open.pop(name)
                del tensor  # the tensor exports the mapping's buffer: drop it before closing
                _close(mapping)

    def close(self) -> None:
        mappings = [mapping for _, mapping in self._open.values()]
        self._open.clear()
        for mapping in mappings:
            _close(mapping)


def _close(mapping: mmap.mmap) -> None:
    try:
        mapping.close()
    except BufferError:  # a tensor still views it; the mapping goes with the process
        pass

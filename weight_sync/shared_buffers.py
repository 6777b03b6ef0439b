"""Buffers another process on the same host can map without copying: the colocated transport.

* CPU: POSIX shared memory (`multiprocessing.shared_memory`); the handle is the segment's name,
  a plain string that crosses any channel (pipes, Ray calls).
* CUDA: the buffer's CUDA IPC handle, via torch's own tensor reduction; the receiver rebuilds a
  tensor over the same device memory.

Either way only the handle and the manifest are pickled, never the bytes.
"""

from __future__ import annotations

import mmap
import os
from multiprocessing import shared_memory
from typing import Any, NamedTuple

import torch


class BufferHandle(NamedTuple):
    kind: str  # "shm" | "cuda_ipc"
    payload: Any  # shm: (name, numel, dtype); cuda_ipc: torch's (rebuild_fn, args)


class SharedBufferAllocator:
    """Allocates the sender's bucket buffers in memory the receiver can open; keeps them alive."""

    def __init__(self, device: torch.device | str = "cpu"):
        self.device = torch.device(device)
        self._segments: dict[int, shared_memory.SharedMemory] = {}
        self._handles: dict[int, BufferHandle] = {}
        self._buffers: dict[int, torch.Tensor] = {}

    def __call__(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        if self.device.type == "cuda":
            buffer = torch.empty(numel, dtype=dtype, device=self.device)
            from torch.multiprocessing.reductions import reduce_tensor

            self._handles[buffer.data_ptr()] = BufferHandle("cuda_ipc", reduce_tensor(buffer))
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
        return self._handles[buffer.data_ptr()]

    def buffer(self, handle: BufferHandle) -> torch.Tensor:
        """The sender's own view of a handle it gave out (for receivers that cannot map it:
        another node gets the bytes instead)."""
        for ptr, h in self._handles.items():
            if h is handle:
                return self._buffers[ptr]
        raise KeyError("not a handle of this allocator")

    def close(self) -> None:
        """Unlink the segments (receivers that still map them keep their mappings)."""
        for segment in self._segments.values():
            segment.unlink()
            try:
                segment.close()
            except BufferError:  # a tensor still views it; the mapping goes with the process
                pass
        self._segments.clear()
        self._handles.clear()
        self._buffers.clear()


class BufferOpener:
    """Receiver side: maps handles to tensors, once per buffer (senders reuse their buffers).

    Shared-memory segments are mapped directly (shm_open + mmap) rather than through
    `SharedMemory`, whose resource tracker would claim the creator's segment in this process."""

    def __init__(self):
        self._open: dict[Any, tuple[torch.Tensor, mmap.mmap | None]] = {}

    def open(self, handle: BufferHandle) -> torch.Tensor:
        if handle.kind == "shm":
            name, numel, dtype = handle.payload
            if name not in self._open:
                import _posixshmem

                fd = _posixshmem.shm_open("/" + name.lstrip("/"), os.O_RDWR, mode=0o600)
                try:
                    mapping = mmap.mmap(fd, os.fstat(fd).st_size)
                finally:
                    os.close(fd)
                self._open[name] = (torch.frombuffer(mapping, dtype=dtype, count=numel), mapping)
            return self._open[name][0]
        if handle.kind == "cuda_ipc":
            rebuild, args = handle.payload
            return rebuild(*args)
        raise ValueError(f"unknown buffer handle kind {handle.kind!r}")

    def close(self) -> None:
        mappings = [mapping for _, mapping in self._open.values() if mapping is not None]
        self._open.clear()
        for mapping in mappings:
            try:
                mapping.close()
            except BufferError:  # a tensor still views it; the mapping goes with the process
                pass

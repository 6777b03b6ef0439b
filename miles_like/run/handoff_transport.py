"""How a prefill replica's handoffs reach a decode replica's actor (`rollout.handoff`).

On one node the K/V travels through memory both processes map, the colocated weight sync's
transport (`weight_sync.shared_buffers`): POSIX shared memory on CPU, CUDA IPC on GPU (the
handle names its GPU by UUID, and the decode actor maps it on whichever of its visible devices
that is, or refuses it: one GPU per actor). The prefill actor copies each handoff's tensors into
such buffers once (`HandoffSender.share`); only the handles and the small fields go through the
Ray call; the decode actor copies them into its own device memory (`HandoffReceiver.open`), after
which the prefill actor frees its buffers (`HandoffSender.release`). Neither Ray's object store
nor the controller ever holds the bytes. Between nodes the tensors themselves go through Ray's
object store (`share` is skipped: the handoffs are returned as they are).

A buffer whose prefill actor died before the decode side opened it is gone (the OS or the
driver freed it): `open` raises `HandoffGone`, and the caller prefills again.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import torch

from rollout.handoff import PrefillHandoff
from weight_sync.device_ops import DeviceOps
from weight_sync.identity import visible_gpus
from weight_sync.shared_buffers import BufferHandle, BufferOpener, SharedBufferAllocator


class HandoffGone(RuntimeError):
    """A shared handoff's buffers were freed before the decode side opened them."""


class HandoffSender:
    """Prefill side: each `share` call's buffers, kept until `release(key)` (any thread: the
    actor's endpoint calls share concurrently)."""

    def __init__(self, device: torch.device | str):
        self.device = torch.device(device)
        self._held: dict[int, SharedBufferAllocator] = {}
        self._next_key = 0
        self._lock = threading.Lock()

    def share(self, handoffs: list[PrefillHandoff]) -> tuple[int, list[PrefillHandoff]]:
        """(key, the handoffs with every tensor replaced by a `BufferHandle` of a copy)."""
        allocator = SharedBufferAllocator(self.device)
        with self._lock:
            key, self._next_key = self._next_key, self._next_key + 1
            self._held[key] = allocator

        def shared(t: torch.Tensor | None) -> tuple[BufferHandle, tuple[int, ...]] | None:
            if t is None:
                return None
            buffer = allocator(t.numel(), t.dtype)
            buffer.copy_(t.reshape(-1))
            DeviceOps().synchronize(self.device)  # filled before shared (a no-op on CPU)
            return (allocator.handle(buffer), tuple(t.shape))

        return key, [
            h._replace(k=shared(h.k), v=shared(h.v), routes=shared(h.routes)) for h in handoffs
        ]

    def release(self, key: int) -> None:
        """Free the buffers of `share` call `key` (the decode side has copied them; a key
        released already is ignored)."""
        with self._lock:
            allocator = self._held.pop(key, None)
        if allocator is not None:
            allocator.release()

    def release_all(self) -> None:
        with self._lock:
            keys = list(self._held)
        for key in keys:
            self.release(key)

    @property
    def held(self) -> int:
        """`share` calls whose buffers are still held."""
        return len(self._held)


class HandoffReceiver:
    """Decode side: shared handoffs as handoffs whose tensors are this process's own copies on
    `device`. `gpus` maps GPU UUIDs to local device indices (a parameter so a CPU test can stand
    in for a GPU, as `BufferOpener`'s)."""

    def __init__(self, device: torch.device | str, gpus: Callable[[], dict] = visible_gpus):
        self.device = torch.device(device)
        self._opener = BufferOpener(gpus)

    def open(self, handoffs: list[PrefillHandoff]) -> list[PrefillHandoff]:
        def local(shared) -> torch.Tensor | None:
            if shared is None:
                return None
            if isinstance(shared, torch.Tensor):  # from another node: the tensor itself
                return shared.to(self.device)
            handle, shape = shared
            try:
                buffer = self._opener.open(handle)
            except (FileNotFoundError, RuntimeError) as e:  # its sender died and freed it
                raise HandoffGone(f"a prefill handoff's buffer is gone ({e})") from e
            return buffer.reshape(shape).to(self.device, copy=True)

        opened = [h._replace(k=local(h.k), v=local(h.v), routes=local(h.routes)) for h in handoffs]
        DeviceOps().synchronize(self.device)  # copied before the release (a no-op on CPU)
        return opened

    def close(self) -> None:
        self._opener.close()


def nbytes(handoffs: list[PrefillHandoff]) -> int:
    """The tensor bytes the handoffs move (K, V and a mixture's routes)."""
    return sum(h.nbytes for h in handoffs)

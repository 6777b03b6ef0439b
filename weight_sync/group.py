"""The process group weight sync broadcasts over.

It joins the trainer's source ranks (TP rank 0 of each pipeline stage) and the engines, so it
cannot be the trainer's torch.distributed world (engines are not trainer ranks, and megatron owns
that world's layout). `SyncGroup.create` builds a standalone gloo (CPU) or NCCL (GPU) group from
its own TCP store; `SyncGroup.default()` wraps the default world, for programs whose world *is*
the sync group. Ranks here are ranks within this group.
"""

from __future__ import annotations

import pickle
from datetime import timedelta

import torch
import torch.distributed as dist

import collectives


class SyncGroup:
    def __init__(self, process_group, rank: int, size: int, device: torch.device):
        self.pg = process_group  # None: the default world, through torch.distributed
        self.rank, self.size, self.device = rank, size, device

    @classmethod
    def create(
        cls,
        host: str,
        port: int,
        rank: int,
        size: int,
        backend: str = "gloo",
        timeout_s: float = 300.0,
        master_store: dist.TCPStore | None = None,
    ) -> SyncGroup:
        """Every member calls this with the same host/port/size; rank 0 hosts the store (or
        passes `master_store`, one already listening on that port). Joining, and every
        collective of the group, fails after `timeout_s` instead of hanging (on a dead or stuck
        member)."""
        timeout = timedelta(seconds=timeout_s)
        if master_store is None:
            master_store = dist.TCPStore(host, port, size, is_master=rank == 0, timeout=timeout)
        store = dist.PrefixStore("weight_sync", master_store)
        if backend == "gloo":
            return cls(
                dist.ProcessGroupGloo(store, rank, size, timeout), rank, size, torch.device("cpu")
            )
        if backend == "nccl":
            device = torch.device("cuda", torch.cuda.current_device())
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = timeout  # collectives abort (not hang) past it
            return cls(dist.ProcessGroupNCCL(store, rank, size, options), rank, size, device)
        raise ValueError(f"weight sync backend={backend!r}: use 'gloo' or 'nccl'")

    @classmethod
    def default(cls) -> SyncGroup:
        backend = dist.get_backend()
        device = (
            torch.device("cuda", torch.cuda.current_device())
            if backend == "nccl"
            else torch.device("cpu")
        )
        return cls(None, dist.get_rank(), dist.get_world_size(), device)

    def broadcast(self, tensor: torch.Tensor, src: int) -> None:
        collectives.broadcast(tensor, src, group=self.pg)

    def broadcast_object(self, obj, src: int):
        """Pickled through two tensor broadcasts (length, then bytes); returns src's object."""
        if self.rank == src:
            payload = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8).to(
                self.device
            )
            length = torch.tensor([payload.numel()], dtype=torch.int64, device=self.device)
        else:
            length = torch.zeros(1, dtype=torch.int64, device=self.device)
        self.broadcast(length, src)
        if self.rank != src:
            payload = torch.empty(int(length.item()), dtype=torch.uint8, device=self.device)
        self.broadcast(payload, src)
        return obj if self.rank == src else pickle.loads(payload.cpu().numpy().tobytes())

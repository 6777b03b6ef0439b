"""The communicator of one tensor-parallel engine replica: k processes, one scheduler on rank 0.

Rank 0 runs the whole `Engine` (scheduler, radix cache, sampler) and `send`s every command that
touches device state: each step's forward plan, weight loads, memory release / resume, stop. The
other ranks (`rollout.tp_follower`) `receive` the same commands in the same order and do the same
work on their shard, so every rank's KV pool holds the same pages at the same slots (rank 0's
scheduler decides; the others follow its slot mapping). Collectives inside the forward (all-reduce
after row-parallel layers, all-gather of vocab-sharded logits) use the same group, in the same
order on every rank. The caller creates the torch.distributed group (gloo on CPU, NCCL on GPU).

Commands travel pickled (`collectives.broadcast_object`); their tensors are sent on the CPU and
moved to each rank's own device on arrival (a pickled CUDA tensor would land on the sender's
device index).
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

import collectives


class Forward(NamedTuple):
    plan: Any  # rollout.model_runner.StepPlan
    page_copies: tuple[
        tuple[int, int, int], ...
    ]  # (src page, dst page, tokens), before the forward


class LoadWeights(NamedTuple):
    named_tensors: list[tuple[str, torch.Tensor]]  # full Hugging Face tensors (or pre-sharded)


class Release(NamedTuple):
    weights: bool


class Resume(NamedTuple):
    weights: bool  # the parameters' storage (`Engine.resume_weights`)
    kv: bool  # the KV pool, sized again (`Engine.alloc_kv`)


class Stop(NamedTuple):
    pass


class ReceiveShards(NamedTuple):
    """Followers: receive this rank's own shards of one weight push on the weight-sync group
    (the resharding sync over broadcasts; the follower's `shard_receive`). It comes as a
    command so that the follower's one serving thread issues it between the TP group's
    collectives: two threads each driving a communicator (NCCL) have no common order."""


def map_tensors(obj: Any, fn) -> Any:
    """`obj` with every tensor inside (tuples, NamedTuples, lists, frozen dataclasses) mapped."""
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return dataclasses.replace(
            obj,
            **{
                f.name: map_tensors(getattr(obj, f.name), fn)
                for f in dataclasses.fields(obj)
                if f.init
            },
        )
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):
        return type(obj)(*(map_tensors(x, fn) for x in obj))
    if isinstance(obj, (tuple, list)):
        return type(obj)(map_tensors(x, fn) for x in obj)
    return obj


class TPGroup:
    def __init__(self, group: dist.ProcessGroup | None = None):
        if not dist.is_initialized():
            raise RuntimeError(
                "EngineConfig.tp > 1 needs torch.distributed initialised "
                "(one process per rank; gloo on CPU, NCCL on GPU) before the engine is built"
            )
        self.group = group if group is not None else dist.group.WORLD
        self.rank = dist.get_rank(self.group)
        self.size = dist.get_world_size(self.group)
        self._cpu = dist.get_backend(self.group) == "gloo"

    # -- shards -------------------------------------------------------------------------------
    def split(self, full: int) -> tuple[int, int]:
        """(start, length) of this rank's even share of `full` (the caller checks k divides it)."""
        length = full // self.size
        return self.rank * length, length

    def vocab_split(self, vocab: int) -> tuple[int, int]:
        """(start, length) of this rank's vocabulary rows: chunks of ceil(vocab / k), the last
        one shorter when k does not divide the vocabulary."""
        chunk = -(-vocab // self.size)
        start = min(self.rank * chunk, vocab)
        return start, min(chunk, vocab - start)

    # -- collectives in the forward -----------------------------------------------------------
    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        return collectives.all_reduce(x, group=self.group)

    def gather_vocab(self, local: torch.Tensor, vocab: int) -> torch.Tensor:
        """[R, local vocab] logits of every rank -> [R, vocab] on every rank, vocabulary order."""
        chunk = -(-vocab // self.size)
        if local.shape[-1] < chunk:  # the short last shard: pad, then drop the padding
            pad = local.new_full((local.shape[0], chunk - local.shape[-1]), float("-inf"))
            local = torch.cat([local, pad], dim=-1)
        return collectives.all_gather(local, dim=-1, group=self.group)[:, :vocab]

    def min_int(self, value: int, device: torch.device) -> int:
        t = torch.tensor([value], dtype=torch.int64, device=device)
        collectives.all_reduce(t, op=collectives.ReduceOp.MIN, group=self.group)
        return int(t.item())

    def barrier(self) -> None:
        """Every rank has reached this point (after a command that others act on directly)."""
        self.min_int(0, torch.device("cpu") if self._cpu else torch.device("cuda"))

    # -- commands -----------------------------------------------------------------------------
    def send(self, command: NamedTuple) -> None:
        assert self.rank == 0, "only rank 0 of a replica sends commands"
        collectives.broadcast_object(
            map_tensors(command, lambda t: t.detach().cpu()), src=0, group=self.group
        )

    def receive(self, device: torch.device) -> NamedTuple:
        command = collectives.broadcast_object(None, src=0, group=self.group)
        return map_tensors(command, lambda t: t.to(device))

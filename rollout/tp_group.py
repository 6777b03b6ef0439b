"""The communicator of one tensor-parallel engine replica: k processes, one scheduler on rank 0.

Rank 0 runs the whole `Engine` (scheduler, radix cache, sampler) and `send`s every command that
touches device state: each step's forward plan, weight loads, memory release / resume, stop. The
other ranks (`rollout.tp_follower`) `receive` the same commands in the same order and do the same
work on their shard, so every rank's KV pool holds the same pages at the same slots (rank 0's
scheduler decides; the others follow its slot mapping). Collectives inside the forward (all-reduce
after row-parallel layers, all-gather of vocab-sharded logits) use the same group, in the same
order on every rank. The caller creates the torch.distributed group (gloo on CPU, NCCL on GPU).

A command travels in two parts: a small pickled header (`collectives.broadcast_object`): the
command with each tensor replaced by its index, and every tensor's shape and dtype; then the
tensors themselves as tensor broadcasts on the group's device (NCCL: the GPU, gloo: the CPU),
never pickled: small ones packed into one flat buffer per dtype, large ones (weights) each on
its own. Each rank moves them to its own device on arrival. A step's plan (token ids, slots,
masks such as the [D, Q, width] suffix bias) thus never goes through the host on its way.
"""

from __future__ import annotations

import copy
import dataclasses
import math
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

import collectives


class Forward(NamedTuple):
    plan: Any  # rollout.model_runner.StepPlan
    # rank 0's pool operations since the last command (`KVPool.copy_log`: page copies, slot
    # writes), replayed before the forward
    pool_ops: tuple


class LoadWeights(NamedTuple):
    named_tensors: list[tuple[str, torch.Tensor]]  # full Hugging Face tensors (or pre-sharded)


class GatherKV(NamedTuple):
    """Every rank reads its KV heads of `slots` (after replaying `pool_ops`, as `Forward`) and
    joins `TPGroup.gather_heads`: rank 0 gets every head (a prefill handoff's K/V)."""

    slots: torch.Tensor
    pool_ops: tuple


class Release(NamedTuple):
    weights: bool


class Resume(NamedTuple):
    weights: bool  # the parameters' storage (`Engine.resume_weights`)
    kv: bool  # the KV pool, sized again (`Engine.alloc_kv`)


class Stop(NamedTuple):
    pass


class CalibrateKV(NamedTuple):
    """Every rank calibrates its FP8 KV pool's scales from its shard of the weights now loaded
    (`rollout.kv_calibration`): the calibration forward runs the TP layers' collectives, so all
    ranks run it together, in the order of rank 0's commands."""


class ReceiveShards(NamedTuple):
    """Followers: receive this rank's own shards of one weight push on the weight-sync group
    (the resharding sync over broadcasts; the follower's `shard_receive`). It comes as a
    command so that the follower's one serving thread issues it between the TP group's
    collectives: two threads each driving a communicator (NCCL) have no common order."""


def map_tensors(obj: Any, fn) -> Any:
    """`obj` with every tensor inside (tuples, NamedTuples, lists, frozen dataclasses) mapped.
    A dataclass is rebuilt field by field without running its `__init__` (its derived fields,
    `init=False`, are mapped like the others)."""
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        mapped = copy.copy(obj)
        for f in dataclasses.fields(obj):
            object.__setattr__(mapped, f.name, map_tensors(getattr(obj, f.name), fn))
        return mapped
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):
        return type(obj)(*(map_tensors(x, fn) for x in obj))
    if isinstance(obj, (tuple, list)):
        return type(obj)(map_tensors(x, fn) for x in obj)
    return obj


# Tensors of at most this many bytes travel packed with the others of their dtype (one
# broadcast per dtype); larger ones (weights) are broadcast each on its own, without a copy.
PACK_LIMIT_BYTES = 1 << 20


class TensorRef(NamedTuple):
    """A tensor's place in a command's header: its index among the tensors sent after it."""

    index: int


class TensorSpec(NamedTuple):
    shape: tuple[int, ...]
    dtype: torch.dtype
    packed: bool


class Header(NamedTuple):
    """What travels pickled: the command with TensorRefs for its tensors, and their specs."""

    skeleton: Any
    specs: tuple[TensorSpec, ...]


def split_command(command: Any) -> tuple[Header, list[torch.Tensor]]:
    """(header, tensors): the command's tensors in the order of their TensorRefs."""
    tensors: list[torch.Tensor] = []

    def take(t: torch.Tensor) -> TensorRef:
        tensors.append(t.detach())
        return TensorRef(len(tensors) - 1)

    skeleton = map_tensors(command, take)
    specs = tuple(
        TensorSpec(tuple(t.shape), t.dtype, t.numel() * t.element_size() <= PACK_LIMIT_BYTES)
        for t in tensors
    )
    return Header(skeleton, specs), tensors


def join_command(header: Header, tensors: list[torch.Tensor]) -> Any:
    """The command of `header` with its TensorRefs replaced by `tensors` (split_command's
    inverse)."""

    def put(obj: Any) -> Any:
        if isinstance(obj, TensorRef):
            return tensors[obj.index]
        if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
            filled = copy.copy(obj)
            for f in dataclasses.fields(obj):
                object.__setattr__(filled, f.name, put(getattr(obj, f.name)))
            return filled
        if isinstance(obj, tuple) and hasattr(obj, "_fields"):
            return type(obj)(*(put(x) for x in obj))
        if isinstance(obj, (tuple, list)):
            return type(obj)(put(x) for x in obj)
        return obj

    return put(header.skeleton)


# Travel as their bytes (uint8): not every backend broadcasts bool, and gloo no float8.
_AS_BYTES = (torch.bool, torch.float8_e4m3fn, torch.float8_e5m2)


def _wire(dtype: torch.dtype) -> torch.dtype:
    """The dtype a tensor travels as: bool and float8 as uint8."""
    return torch.uint8 if dtype in _AS_BYTES else dtype


def _packs(specs: tuple[TensorSpec, ...]) -> dict[torch.dtype, list[int]]:
    """Indices of the packed tensors, by wire dtype, in order."""
    packs: dict[torch.dtype, list[int]] = {}
    for i, spec in enumerate(specs):
        if spec.packed:
            packs.setdefault(_wire(spec.dtype), []).append(i)
    return packs


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

    def gather_heads(self, x: torch.Tensor) -> torch.Tensor | None:
        """[L, local KV heads, ...] of every rank -> [L, KV heads, ...] on rank 0, heads in rank
        order (None on the others: only rank 0 hands the K/V on)."""
        return collectives.gather(x, dst=0, dim=1, group=self.group)

    def min_int(self, value: int, device: torch.device) -> int:
        t = torch.tensor([value], dtype=torch.int64, device=device)
        collectives.all_reduce(t, op=collectives.ReduceOp.MIN, group=self.group)
        return int(t.item())

    def barrier(self) -> None:
        """Every rank has reached this point (after a command that others act on directly)."""
        self.min_int(0, torch.device("cpu") if self._cpu else torch.device("cuda"))

    # -- commands -----------------------------------------------------------------------------
    def send(self, command: NamedTuple) -> None:
        """Every rank's `receive` returns `command` (see the module docstring for how)."""
        assert self.rank == 0, "only rank 0 of a replica sends commands"
        header, tensors = split_command(command)
        collectives.broadcast_object(header, src=0, group=self.group)
        on_wire = [t.view(torch.uint8) if t.dtype in _AS_BYTES else t for t in tensors]
        wire = collectives.group_device(self.group)
        for indices in _packs(header.specs).values():
            if sum(on_wire[i].numel() for i in indices):
                flat = torch.cat([on_wire[i].to(wire).reshape(-1) for i in indices])
                collectives.broadcast(flat, src=0, group=self.group)
        for i, spec in enumerate(header.specs):
            if not spec.packed:
                collectives.broadcast(on_wire[i], src=0, group=self.group)

    def receive(self, device: torch.device) -> NamedTuple:
        """The next command rank 0 `send`s, its tensors on `device`."""
        header = collectives.broadcast_object(None, src=0, group=self.group)
        wire = collectives.group_device(self.group)
        tensors: list[torch.Tensor | None] = [None] * len(header.specs)
        for dtype, indices in _packs(header.specs).items():
            sizes = [math.prod(header.specs[i].shape) for i in indices]
            flat = torch.empty(sum(sizes), dtype=dtype, device=wire)
            if flat.numel():
                collectives.broadcast(flat, src=0, group=self.group)
            for i, part in zip(indices, flat.split(sizes)):
                tensors[i] = part.view(header.specs[i].shape)
        for i, spec in enumerate(header.specs):
            if not spec.packed:
                tensors[i] = torch.empty(spec.shape, dtype=_wire(spec.dtype), device=wire)
                collectives.broadcast(tensors[i], src=0, group=self.group)
        arrived = [
            (t.view(spec.dtype) if spec.dtype in _AS_BYTES else t).to(device)
            for t, spec in zip(tensors, header.specs)
        ]
        return join_command(header, arrived)

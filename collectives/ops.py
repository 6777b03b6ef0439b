"""The collectives: each takes the group, runs on the group's device, answers on the caller's.

Ranks (`src`) are ranks *within* the group, for every group, so a caller never converts between
group and global ranks. Groups are those of the torch.distributed world (`None`: the world
itself, or one `new_group` / megatron made) or a standalone `ProcessGroup` built from its own
store (weight_sync's `SyncGroup`), which the world's group map does not know.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

ReduceOp = dist.ReduceOp

Group = dist.ProcessGroup | None


def _backend(group: Group) -> str | None:
    """The group's backend name, or None for a standalone group (its own store), which the
    world's group map does not know."""
    try:
        return str(dist.get_backend(group))
    except ValueError:
        return None


def _standalone(group: Group) -> bool:
    # torch.distributed's functions run a standalone group's collectives, but their error
    # path looks the group up in the world's map and replaces a timeout's RuntimeError with a
    # ValueError: so its own methods are called instead
    return group is not None and _backend(group) is None


def group_device(group: Group = None) -> torch.device:
    """Where `group`'s collectives take their tensors: the current CUDA device when the group
    has NCCL (a world of "cpu:gloo,cuda:nccl" too: NCCL is the fast path), else the CPU."""
    if "nccl" in (_backend(group) or group.name()):
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def size(group: Group = None) -> int:
    return group.size() if _standalone(group) else dist.get_world_size(group)


def _on(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`tensor` itself when it is contiguous on `device` (the common case: nothing moves),
    else a contiguous copy there."""
    if tensor.device != device:
        tensor = tensor.to(device)
    return tensor.contiguous()


def all_reduce(
    tensor: torch.Tensor, op: dist.ReduceOp = ReduceOp.SUM, group: Group = None
) -> torch.Tensor:
    """Reduce `tensor` over `group` in place (as torch's) and return it."""
    if size(group) == 1:
        return tensor
    work = _on(tensor, group_device(group))
    if _standalone(group):
        options = dist.AllreduceOptions()
        options.reduceOp = op
        group.allreduce([work], options).wait()
    else:
        dist.all_reduce(work, op=op, group=group)
    if work is not tensor:
        tensor.copy_(work)
    return tensor


def all_gather(tensor: torch.Tensor, *, dim: int = 0, group: Group = None) -> torch.Tensor:
    """Every rank's `tensor` (one shape on every rank) concatenated along `dim` in rank order
    (a scalar: stacked), on `tensor`'s device. One collective into one buffer."""
    n = size(group)
    if n == 1:
        return tensor if tensor.dim() else tensor.reshape(1)
    device = group_device(group)
    local = _on(tensor, device)
    out = torch.empty((n, *local.shape), dtype=local.dtype, device=device)
    # into views of one buffer: no copy out of a list afterwards (and this form is the one
    # every torch and backend takes: gloo wants a flat output for `all_gather_into_tensor`)
    if _standalone(group):
        group.allgather([list(out.unbind(0))], [local]).wait()
    else:
        dist.all_gather(list(out.unbind(0)), local, group=group)
    if tensor.dim() == 0:  # scalars: one entry per rank
        return out.to(tensor.device)
    dim = dim % tensor.dim()
    # [n, ..., d, ...] -> [..., n * d, ...]: rank r's block is [r d, (r + 1) d) along `dim`
    return out.movedim(0, dim).flatten(dim, dim + 1).to(tensor.device)


def gather(
    tensor: torch.Tensor, *, dst: int = 0, dim: int = 0, group: Group = None
) -> torch.Tensor | None:
    """`all_gather`'s answer on group rank `dst` only (None on the others), which alone receives:
    the other ranks send their part and get nothing back."""
    n = size(group)
    if n == 1:
        return tensor if tensor.dim() else tensor.reshape(1)
    device = group_device(group)
    local = _on(tensor, device)
    mine = _rank(group) == dst
    out = torch.empty((n, *local.shape), dtype=local.dtype, device=device) if mine else None
    parts = list(out.unbind(0)) if mine else []
    if _standalone(group):
        options = dist.GatherOptions()
        options.rootRank = dst
        group.gather([parts] if mine else [], [local], options).wait()
    else:
        dist.gather(local, parts if mine else None, group=group, group_dst=dst)
    if not mine:
        return None
    if tensor.dim() == 0:
        return out.to(tensor.device)
    dim = dim % tensor.dim()
    return out.movedim(0, dim).flatten(dim, dim + 1).to(tensor.device)


def _rank(group: Group) -> int:
    return group.rank() if _standalone(group) else dist.get_rank(group)


def broadcast(tensor: torch.Tensor, src: int, group: Group = None) -> torch.Tensor:
    """Group rank `src`'s `tensor` into every rank's `tensor` (in place), returned."""
    if size(group) == 1:
        return tensor
    work = _on(tensor, group_device(group))
    if _standalone(group):
        group.broadcast(work, src).wait()
    else:
        dist.broadcast(work, group=group, group_src=src)
    if work is not tensor:
        tensor.copy_(work)
    return tensor


def all_to_all_single(
    output: torch.Tensor,
    input: torch.Tensor,
    output_split_sizes: Sequence[int],
    input_split_sizes: Sequence[int],
    group: Group = None,
) -> torch.Tensor:
    """Rows `input_split_sizes[r]` of `input` to rank r; `output` (filled in place, returned)
    gets `output_split_sizes[r]` rows from rank r. A group of the world only (a standalone
    gloo group has no all-to-all)."""
    if size(group) == 1:
        return output.copy_(input)
    device = group_device(group)
    work = _on(output, device)
    dist.all_to_all_single(
        work,
        _on(input, device),
        output_split_sizes=list(output_split_sizes),
        input_split_sizes=list(input_split_sizes),
        group=group,
    )
    if work is not output:
        output.copy_(work)
    return output


def all_gather_object(obj: Any, group: Group = None) -> list:
    """Every rank's picklable `obj`, in rank order. torch pickles it into a byte tensor on the
    group's device itself; a tensor inside comes back on the device it was pickled from, so
    send host tensors (or move them on arrival)."""
    n = size(group)
    if n == 1:
        return [obj]
    parts: list = [None] * n
    dist.all_gather_object(parts, obj, group=group)
    return parts


def broadcast_object(obj: Any, src: int, group: Group = None) -> Any:
    """Group rank `src`'s picklable `obj` on every rank (what other ranks pass is ignored)."""
    if size(group) == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, group=group, group_src=src)
    return box[0]

"""Every torch.distributed collective of the tree, with its tensors on the group's device.

An NCCL group reduces CUDA tensors only and a gloo group host tensors only; a tensor on the
wrong side fails at the call (`No backend type associated with device type cpu`) and only on
the machine that has that backend, which CI does not. So no code of ours calls a
`torch.distributed` collective directly: it calls one of these, which moves the tensor to the
group's device (`group_device`: the current CUDA device for NCCL, the CPU for gloo), runs the
collective there and hands the result back on the caller's device. A tensor already on the
group's device moves nothing, and nothing here reads a value back to the host (no per-element
synchronisation; a caller that wants numbers stacks them and reads them once).

A group of one is no collective at all: the calls return their input (a 1-process world on a
laptop pays nothing, and an all-gather of one part is the part itself).

A leaf package (torch only), so `rollout`, `trainer` and `weight_sync`, which never import one
another, share it. `tests/test_layout.py` checks that no raw collective call remains outside it.
"""

from collectives.ops import (
    ReduceOp,
    all_gather,
    all_gather_object,
    all_reduce,
    all_to_all_single,
    broadcast,
    broadcast_object,
    gather,
    group_device,
    size,
)

__all__ = [
    "ReduceOp",
    "all_gather",
    "all_gather_object",
    "all_reduce",
    "all_to_all_single",
    "broadcast",
    "broadcast_object",
    "gather",
    "group_device",
    "size",
]

"""Which micro-batch's shared-prompt layout (`packing.SharedPrompts`) a forward is computing.

megatron hands its core attention the `PackedSeqParams` and RoPE only the `cu_seqlens` tensor,
so the layout is bound to that tensor, by identity, before the model runs (`bind`), and both
look it up (`layout_for`). A tensor no layout is bound to (every unshared micro-batch) gets
None. Only a forward reads the layout; the backward uses what the forward saved.
"""

from __future__ import annotations

import torch

from trainer.packing import SharedPrompts

_bound: tuple[torch.Tensor, SharedPrompts] | None = None


def bind(cu_seqlens: torch.Tensor, layout: SharedPrompts | None) -> None:
    global _bound
    _bound = None if layout is None else (cu_seqlens, layout)


def layout_for(cu_seqlens: torch.Tensor | None) -> SharedPrompts | None:
    if _bound is None or cu_seqlens is None or _bound[0] is not cu_seqlens:
        return None
    return _bound[1]


def to_device(layout: SharedPrompts, device: torch.device) -> SharedPrompts:
    return layout._replace(
        **{k: getattr(layout, k).to(device) for k in ("positions", "expand", "cu_seqlens", "pick")}
    )

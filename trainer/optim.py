"""Learning-rate schedule and model-parallel-aware gradient norm / clipping.

megatron-core's `clip_grads` allocates on "cuda", so the CPU path computes the same quantity
here: the L2 norm of the full model's gradient, where TP-sharded parameters contribute every
shard, TP-replicated parameters (norms, biases of row-parallel layers) count once, and the tied
embedding's duplicate on the last PP stage is skipped.
"""

from __future__ import annotations

import math

import torch
from megatron.core import parallel_state
from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate
from megatron.core.transformer.module import param_is_not_shared

import collectives
from trainer.config import OptimConfig


def lr_at(step: int, cfg: OptimConfig) -> float:
    """LR for optimizer step `step` (0-based): linear warmup from lr / warmup_steps to lr over
    `warmup_steps` steps, then constant or cosine down to min_lr at `total_steps`."""
    if cfg.warmup_steps and step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    if cfg.lr_schedule == "constant":
        return cfg.lr
    span = max(cfg.total_steps - cfg.warmup_steps, 1)
    progress = min(max(step - cfg.warmup_steps, 0) / span, 1.0)
    return cfg.min_lr + 0.5 * (cfg.lr - cfg.min_lr) * (1.0 + math.cos(math.pi * progress))


def grad_norm(
    params: list[torch.Tensor], *, model_parallel: bool = True, data_parallel_shards: bool = False
) -> float:
    """Global L2 norm of `.grad` over the whole (TP x PP sharded) model, accumulated in float64.
    `data_parallel_shards`: each DP rank holds a disjoint shard of every gradient (a
    distributed optimizer's), so the squares are summed over DP as well.

    On the gradients' device: every tensor's norm in one `_foreach_norm` (each a float64-
    accumulating reduction, no float64 copy of the gradient), their squares summed there, one
    all-reduce per group on its device, and one read-back: a single host synchronisation per
    step, whatever the number of parameters."""
    grads = [
        p.grad.detach()
        for p in params
        if p.grad is not None
        and (
            not model_parallel
            or (param_is_not_shared(p) and param_is_not_tensor_parallel_duplicate(p))
        )
    ]
    group = parallel_state.get_model_parallel_group() if model_parallel else None
    if grads:
        sq = torch.stack(torch._foreach_norm(grads, 2, dtype=torch.float64)).square().sum()
    else:  # this rank holds no gradient; its share is 0
        device = collectives.group_device(group) if model_parallel else torch.device("cpu")
        sq = torch.zeros((), dtype=torch.float64, device=device)
    if data_parallel_shards:
        collectives.all_reduce(sq, group=parallel_state.get_data_parallel_group())
    if model_parallel:
        collectives.all_reduce(sq, group=group)
    return float(sq.sqrt())


def clip_grads_(params: list[torch.nn.Parameter], max_norm: float | None, norm: float) -> None:
    if max_norm is None or norm <= max_norm:
        return
    scale = max_norm / (norm + 1e-6)
    torch._foreach_mul_([p.grad for p in params if p.grad is not None], scale)


def load_optimizer_state(optimizer: torch.optim.Optimizer, state: dict) -> None:
    """`optimizer.load_state_dict(state)`, keeping the optimizer's own `fused` setting.

    A state saved by an unfused AdamW (checkpoints from before the fused one) carries
    `fused: None` in its param groups, which `load_state_dict` would restore; the update is the
    same either way (up to rounding), so the fused kernel is kept, with each `step` counter on
    its parameter's device as the fused kernel wants it (unfused AdamW keeps it on the host)."""
    fused = [group.get("fused") for group in optimizer.param_groups]
    optimizer.load_state_dict(state)
    for group, was in zip(optimizer.param_groups, fused, strict=True):
        if not was:
            continue
        group["fused"] = was
        for p in group["params"]:
            st = optimizer.state.get(p)
            if st and torch.is_tensor(st.get("step")):
                st["step"] = st["step"].to(p.device, torch.float32)

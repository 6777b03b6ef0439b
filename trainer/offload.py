"""Move training state between device and host memory between phases (colocated rollout).

Functions return the bytes they moved. When source and target are the same device (a CPU-only
machine) `.to()` is a no-op; the byte count is still measured, so the controller's
`perf/weight_sync_bytes`-style accounting means the same thing everywhere.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Literal

import torch

# What an `offload` moves: "optimizer" is the state a weight push does not read (gradients,
# separate fp32 masters, optimizer moments), "weights" the rest, "all" both. Colocated on a GPU
# the optimizer part leaves before the engines take their weights back, the weights after the
# push (`miles_like.run.loop`).
OffloadPart = Literal["all", "optimizer", "weights"]


def tensors_bytes(tensors: Iterable[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def move_params(params: Iterable[torch.nn.Parameter], device: torch.device) -> int:
    """Rebind each parameter's data to `device` (the Parameter objects, hence optimizer and
    module references, stay the same)."""
    moved = 0
    for p in params:
        moved += p.numel() * p.element_size()
        p.data = p.data.to(device, non_blocking=True)
    return moved


def move_optimizer_state(optimizer: torch.optim.Optimizer, device: torch.device) -> int:
    moved = 0
    for state in optimizer.state.values():
        for key, value in state.items():
            if torch.is_tensor(value) and value.dim() > 0:
                moved += value.numel() * value.element_size()
                state[key] = value.to(device, non_blocking=True)
    return moved


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)

"""Which device a trainer process computes on, and the collective backend that goes with it.

The launcher decides (the controller's `cluster.accelerator`, passed into each trainer actor)
and says so once with `use`; everything in `trainer/` then asks `current()`. Asking
`torch.cuda.is_available()` inside the process instead would put a trainer on a GPU the recipe
said not to use (`accelerator: cpu` on a GPU host), with NCCL groups its CPU peers cannot join.
A process whose launcher said nothing (a test, a laptop, torchrun) gets the old default: its
CUDA device when CUDA is present, else the CPU.
"""

from __future__ import annotations

import torch

_chosen: torch.device | None = None


def device_for(accelerator: str) -> torch.device:
    """The device of an actor given one accelerator of kind `accelerator` ("cuda": the one GPU
    Ray made visible to it, index 0; "cpu")."""
    if accelerator == "cuda":
        return torch.device("cuda", 0)
    if accelerator == "cpu":
        return torch.device("cpu")
    raise ValueError(f"accelerator {accelerator!r}: expected 'cuda' or 'cpu'")


def backend_for(device: torch.device | str) -> str:
    """The torch.distributed backend of groups whose tensors live on `device`."""
    return "nccl" if torch.device(device).type == "cuda" else "gloo"


def use(device: torch.device | str) -> None:
    """This process computes on `device` (before building anything)."""
    global _chosen
    _chosen = torch.device(device)


def current() -> torch.device:
    """The chosen device, or, where nobody chose, the current CUDA device if CUDA is present,
    else the CPU."""
    if _chosen is not None:
        if _chosen.type == "cuda" and _chosen.index is None:
            return torch.device("cuda", torch.cuda.current_device())
        return _chosen
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")

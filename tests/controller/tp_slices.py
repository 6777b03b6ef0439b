"""An engine TP rank's slice of each full Hugging Face tensor, written out from the layout rules
(not from `rollout/parallel_layers.py`): the reference the engine TP end-to-end tests compare
every rank's parameters with."""

from __future__ import annotations

import hashlib

import torch

COLUMN = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")  # output rows halved
ROW = ("o_proj", "down_proj")  # input columns halved
VOCAB = ("embed_tokens", "lm_head")  # rows in chunks of ceil(V / k)


def expected_slice(name: str, full: torch.Tensor, k: int, rank: int) -> torch.Tensor:
    module = name.split(".")[-2]
    if module in COLUMN:
        return full.chunk(k, dim=0)[rank]
    if module in ROW:
        return full.chunk(k, dim=1)[rank]
    if module in VOCAB:
        chunk = -(-full.shape[0] // k)
        return full[rank * chunk : (rank + 1) * chunk]
    return full  # norms


def digest(t: torch.Tensor) -> str:
    return hashlib.sha256(
        t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    ).hexdigest()

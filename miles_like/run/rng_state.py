"""The global random number generators of a process (torch CPU and CUDA, Python's `random`,
NumPy's legacy global state) as tensors and plain values: saved in checkpoints with `torch.save`
and read back with `torch.load(weights_only=True)`.

The run's own randomness is explicitly seeded (sampling seeds come from (seed, step, round);
data from `data.shuffle_seed`), so these states matter only to code that draws from the global
generators (a user's reward function, dropout); they are saved so that such code resumes exactly
too.
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch


def capture() -> dict[str, Any]:
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "python": random.getstate(),
        "numpy": (
            kind,
            torch.from_numpy(keys.astype(np.int64)),
            int(pos),
            int(has_gauss),
            float(cached),
        ),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])

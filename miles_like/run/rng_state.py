"""The host's global random number generators of a process (torch CPU, Python's `random`,
NumPy's legacy global state) as tensors and plain values: saved in checkpoints with `torch.save`
and read back with `torch.load(weights_only=True)`.

The run's own randomness is explicitly seeded (sampling seeds come from (seed, step, round);
data from `data.shuffle_seed`), so these states matter only to code that draws from the global
generators (a user's reward function, dropout); they are saved so that such code resumes exactly
too.

No CUDA here: the controller saves its state with these functions, and the controller is a
plain process that sees every GPU of its node; a single `torch.cuda` RNG call there would
create a CUDA context on each of them, memory the engines sized their KV pools without. The
CUDA generator belongs to the process computing on that GPU: a trainer rank adds its own
(`TrainerWorker.save_state`).
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch


def capture() -> dict[str, Any]:
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    return {
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


def restore(state: dict[str, Any]) -> None:
    """Inverse of `capture`; other entries (a trainer rank's CUDA state) are left to their
    owner."""
    torch.set_rng_state(state["torch"])
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, cached))

"""Each sample's own stream of uniforms: what makes seeded sampling repeat."""

from __future__ import annotations

import torch


class UniformStream:
    """One sequence's uniforms in [0, 1): the draws of a `torch.Generator` seeded with `seed`,
    taken `BLOCK` at a time. torch's CPU generator fills a float64 tensor element by element, so
    the numbers and their order are exactly those of one `torch.rand((), generator=g,
    dtype=torch.float64)` per draw (`test_sampler.py` checks it), at a fraction of the per-call
    cost: a decode step draws one per sequence. Seeded on CPU whatever the model's device."""

    BLOCK = 64

    def __init__(self, seed: int):
        self.generator = torch.Generator().manual_seed(seed)
        self._block = iter(())  # the current block's remaining draws

    def draw(self) -> float:
        try:
            return next(self._block)
        except StopIteration:
            block = torch.rand(self.BLOCK, generator=self.generator, dtype=torch.float64)
            self._block = iter(block.tolist())
            return next(self._block)

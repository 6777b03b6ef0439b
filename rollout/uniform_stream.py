"""Each sample's own stream of uniforms: what makes seeded sampling repeat."""

from __future__ import annotations

import numpy as np
import torch


class UniformStream:
    """One sequence's uniforms in [0, 1): the draws of a `torch.Generator` seeded with `seed`,
    taken `BLOCK` at a time. torch's CPU generator fills a float64 tensor element by element, so
    the numbers and their order are exactly those of one `torch.rand((), generator=g,
    dtype=torch.float64)` per draw (`test_sampler.py` checks it), at a fraction of the per-call
    cost: a decode step draws one per sequence. Seeded on CPU whatever the model's device; a
    block is filled into numpy-owned memory and read with numpy, so a stream never reads a
    tensor back (the engine's host-sync budget counts tensor reads).

    `peek` shows the next draws without taking them and `skip` takes them: speculative
    verification reads every uniform a sequence may need on the device at once and takes only
    those its accept/reject walk used, so the stream advances exactly as drawing one at a time."""

    BLOCK = 64

    def __init__(self, seed: int):
        self.generator = torch.Generator().manual_seed(seed)
        # the generator writes into host memory that torch only borrows while it fills it (no
        # tensor outlives a refill: the stream holds no torch storage)
        self._array = np.empty(self.BLOCK, dtype=np.float64)
        self._draws: list[float] = []  # drawn from the generator, not yet taken
        self._next = 0  # _draws[_next:] are still to be taken
        self._filled = 0  # draws the generator has made

    def _refill(self, wanted: int) -> None:
        """At least `wanted` draws not yet taken."""
        pending = self._draws[self._next :]
        while len(pending) < wanted:
            fill = torch.from_numpy(self._array)
            torch.rand(self.BLOCK, generator=self.generator, dtype=torch.float64, out=fill)
            pending += self._array.tolist()
            self._filled += self.BLOCK
        self._draws, self._next = pending, 0

    @property
    def taken(self) -> int:
        """Draws taken so far: a stream seeded alike that `skip`s them continues this one."""
        return self._filled - (len(self._draws) - self._next)

    def draw(self) -> float:
        if self._next == len(self._draws):
            self._refill(1)
        u = self._draws[self._next]
        self._next += 1
        return u

    def peek(self, n: int) -> list[float]:
        """The next `n` draws, left in the stream."""
        if len(self._draws) - self._next < n:
            self._refill(n)
        return self._draws[self._next : self._next + n]

    def skip(self, n: int) -> None:
        """Take `n` draws (as `n` calls of `draw`, their values unused)."""
        if len(self._draws) - self._next < n:
            self._refill(n)
        self._next += n

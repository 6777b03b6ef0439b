"""Contiguous near-equal shares: a step's groups over the engine replicas, a batch over its
mini-batch updates.

Group k of a batch lives on the replica whose share holds k, shares in replica order, the
first `n % parts` one larger. Placement is arithmetic, not timing, so a resumed run and every
mode (synchronous, over-sampled, fully asynchronous) put a data position on the same replica.
"""

from __future__ import annotations


def near_equal_shares(n: int, parts: int) -> list[range]:
    """`range(n)` cut into `parts` consecutive shares whose lengths differ by at most one, the
    longer ones first (fewer items than parts: the last shares are empty)."""
    size, extra = divmod(n, parts)
    out, start = [], 0
    for i in range(parts):
        end = start + size + (i < extra)
        out.append(range(start, end))
        start = end
    return out


def replica_of(position: int, per_batch: int, replicas: int) -> int:
    """The replica of the group at `position` of its batch of `per_batch` groups."""
    shares = near_equal_shares(per_batch, replicas)
    return next(i for i, share in enumerate(shares) if position in share)

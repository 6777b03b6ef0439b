"""Contiguous near-equal shares: how a rollout's groups are placed on the engine replicas.

Group k of a batch lives on the replica whose share holds k, shares in replica order, the
first `n % parts` one larger. Placement is arithmetic, not timing, so a resumed run and every
mode (synchronous, over-sampled, fully asynchronous) put a data position on the same replica.
"""

from __future__ import annotations


def split(n: int, parts: int) -> list[range]:
    """`range(n)` cut into `parts` contiguous shares whose sizes differ by at most one, the
    larger ones first (fewer items than parts: the last shares are empty)."""
    size, extra = divmod(n, parts)
    out, start = [], 0
    for i in range(parts):
        end = start + size + (i < extra)
        out.append(range(start, end))
        start = end
    return out


def replica_of(position: int, per_batch: int, replicas: int) -> int:
    """The replica of the group at `position` of its batch of `per_batch` groups."""
    return next(i for i, share in enumerate(split(per_batch, replicas)) if position in share)

"""A train step's metrics from its micro-batches' shares: reduced on the device, read once.

Each micro-batch's loss function returns its *share* of every metric (`objective`): the shares
summed over micro-batches and data-parallel ranks give the batch's value, except for the max
keys (`ratio_max`), whose value is the largest share (and at least 0). The shares stay where the
loss computed them, on the device; they are stacked there into one [2, keys] float64 table
(row 0 the sums, row 1 the maxes), reduced over the group on its device (`collectives`), and
read back with a single copy. So a step's metrics cost one host synchronisation, not one per
metric and micro-batch.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

import collectives


def stack_shares(
    stored: Sequence[Mapping[str, torch.Tensor]], keys: Sequence[str], device: torch.device
) -> torch.Tensor:
    """[2, len(keys)] float64 on `device`: every key's shares summed (row 0) and maxed (row 1)
    over `stored`, one dict of scalar tensors per micro-batch (none: zeros)."""
    table = torch.zeros((1 + len(stored), len(keys)), dtype=torch.float64, device=device)
    if stored:  # row 0 stays 0: the sum's neutral element and the maxes' floor
        table[1:] = torch.stack(
            [torch.stack([torch.as_tensor(m[k]).to(table) for k in keys]) for m in stored]
        )
    return torch.stack([table.sum(dim=0), table.amax(dim=0)])


def reduce_shares(shares: torch.Tensor, group=None) -> torch.Tensor:
    """`stack_shares`' table summed / maxed over the ranks of `group`, in place."""
    collectives.all_reduce(shares[0], group=group)
    collectives.all_reduce(shares[1], op=collectives.ReduceOp.MAX, group=group)
    return shares


def read_metrics(
    shares: torch.Tensor, keys: Sequence[str], max_keys: Sequence[str] = ()
) -> dict[str, float]:
    """The metrics of a reduced table: one device-to-host copy."""
    sums, maxes = shares.tolist()
    return {k: maxes[j] if k in max_keys else sums[j] for j, k in enumerate(keys)}

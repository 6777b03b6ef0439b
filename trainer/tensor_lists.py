"""A list of small tensors pickled as one: how an `RLBatch` crosses a process boundary.

Pickling a CPU tensor serialises its storage on its own (torch writes, and reads back, one
small archive per tensor), so a batch of a few hundred samples with a few per-token fields each
costs the sender and the receiver tens of milliseconds of CPU on every Ray call (`ray.put`,
the trainer's argument fetch), paid on the trainer's critical path. `pack` concatenates a field
into one flat tensor (plus the lengths); `unpack` splits it back. Values and dtypes round-trip
exactly; the unpacked tensors are disjoint views of the one received buffer.

Only lists of 1-D CPU tensors of one dtype, none requiring grad, are packed; anything else
(a GPU tensor, another shape, an empty list) is pickled as it is.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch


class PackedTensors(NamedTuple):
    flat: torch.Tensor
    lengths: list[int]


def packable(values: Sequence[torch.Tensor]) -> bool:
    if not values or not all(isinstance(v, torch.Tensor) for v in values):
        return False
    dtype = values[0].dtype
    return all(
        v.dim() == 1 and v.device.type == "cpu" and v.dtype == dtype and not v.requires_grad
        for v in values
    )


def pack(values):
    """`values` as one `PackedTensors` where `packable`, else unchanged."""
    if values is None or not packable(values):
        return values
    return PackedTensors(torch.cat(list(values)), [v.numel() for v in values])


def unpack(values):
    """Inverse of `pack`: a list of tensors (or `values` unchanged if it was not packed)."""
    if isinstance(values, PackedTensors):
        return list(values.flat.split(values.lengths))
    return values

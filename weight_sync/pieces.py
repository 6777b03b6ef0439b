"""Receiver side of tensors split across buckets (`BucketPacker(split_tensors=True)`).

A piece is loaded as soon as its bucket is verified, like any tensor of that bucket: straight
into the engine's parameter where the engine offers it (`load_weight_piece`: it holds the
tensor exactly as sent, so each piece is a range of the parameter's elements), otherwise into a
staging tensor that is loaded whole (`load_weights`) once its last piece is in. Either way a
corrupted bucket loads nothing, pieces included: this runs only after its checksums passed.

The engine's answer for a name must not change between its pieces (it depends on the weight's
name, shape, dtype and placement only); a change is refused rather than mixing both paths.
"""

from __future__ import annotations

import math
from typing import Protocol

import torch

from weight_sync.buckets import TensorEntry
from weight_sync.errors import WeightSyncError


class PieceTarget(Protocol):
    """What an engine offers to take pieces in place (optional for a `WeightReceiver`)."""

    def load_weight_piece(
        self, name: str, shape: tuple[int, ...], start: int, piece: torch.Tensor
    ) -> bool: ...


class SplitTensors:
    """Loads the pieces of split tensors into `engine` (a `WeightReceiver`)."""

    def __init__(self, engine):
        self.engine = engine
        self._direct: dict[str, bool] = {}  # name -> written in place (this sync)
        self._staged: dict[str, tuple[torch.Tensor, int]] = {}  # name -> (tensor, elements in)
        self._partial: dict[str, int] = {}  # written in place, not whole yet: elements in

    def load(self, entry: TensorEntry, piece: torch.Tensor) -> None:
        name = entry.name
        # a tensor's first piece: a new sync of it (an earlier one may have failed)
        if entry.start == 0:
            self._direct.pop(name, None)
            self._staged.pop(name, None)
            self._partial.pop(name, None)
        direct = self._direct.get(name)
        if direct is None or direct:
            offer = getattr(self.engine, "load_weight_piece", None)
            taken = offer is not None and offer(name, entry.shape, entry.start, piece)
            if direct and not taken:
                raise WeightSyncError(
                    f"the engine took the earlier pieces of {name!r} in place but refused the "
                    f"one at element {entry.start}; it must answer the same for every piece"
                )
            self._direct[name] = taken
            if taken:
                filled = self._partial.pop(name, 0) + entry.numel
                if filled < math.prod(entry.shape):
                    self._partial[name] = filled
                return
        self._stage(entry, piece)

    def _stage(self, entry: TensorEntry, piece: torch.Tensor) -> None:
        total = math.prod(entry.shape)
        staged, filled = self._staged.get(entry.name, (None, 0))
        if staged is None:
            staged = torch.empty(total, dtype=piece.dtype, device=piece.device)
        staged[entry.start : entry.start + entry.numel].copy_(piece)
        filled += entry.numel
        if filled < total:
            self._staged[entry.name] = (staged, filled)
            return
        self._staged.pop(entry.name, None)
        self.engine.load_weights([(entry.name, staged.view(entry.shape))])

    def incomplete(self) -> list[str]:
        """Names whose pieces did not all arrive: staged ones (nothing of them loaded) and ones
        written in place in part (the engine holds them half-updated, so it must not commit)."""
        return sorted([*self._staged, *self._partial])

    def reset(self) -> None:
        self._direct.clear()
        self._staged.clear()
        self._partial.clear()

"""DAPO's two batch-level reward rules: the soft overlong penalty and the dynamic-sampling filter.

Pure functions on tensors; the RL loop applies them between scoring and advantages.
"""

from __future__ import annotations

import torch


def overlong_penalty(
    lengths: torch.Tensor, max_new_tokens: int, buffer: int, factor: float = 1.0
) -> torch.Tensor:
    """DAPO soft overlong punishment, added to the reward: 0 up to `max_new_tokens - buffer`
    tokens, then falling linearly to `-factor` at `max_new_tokens` (and staying there).
    `buffer == 0` disables it."""
    lengths = lengths.float()
    if buffer == 0:
        return torch.zeros_like(lengths)
    if not 0 < buffer < max_new_tokens:
        raise ValueError(
            f"overlong buffer={buffer}: use a value in [0, max_new_tokens={max_new_tokens})"
        )
    start = max_new_tokens - buffer
    return -factor * ((lengths - start) / buffer).clamp(min=0.0, max=1.0)


def informative_groups(rewards: torch.Tensor) -> torch.Tensor:
    """[groups, n] rewards -> bool [groups]: False where all n rewards are equal (their group
    advantages are 0: no gradient). Dynamic sampling drops those groups and refills the batch."""
    if rewards.dim() != 2:
        raise ValueError(f"rewards must have shape [groups, n]; got {tuple(rewards.shape)}")
    return (rewards != rewards[:, :1]).any(dim=1)

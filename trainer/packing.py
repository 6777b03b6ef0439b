"""Pack variable-length sequences, without padding, into micro-batches by a token budget.

A micro-batch is one row of `t` tokens: the sequences laid end to end, with `cu_seqlens`
marking where each starts (megatron's `thd` layout). Attention and RoPE restart at every
boundary, so a packed row computes exactly what the sequences would compute one by one.

Next-token alignment: the logit at packed position p predicts `targets[p]`, the following token
of the same sequence; the last position of each sequence has no target (`target_mask` 0).
`response_mask[p]` is 1 where `targets[p]` is a response token (the tokens we train on).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch


class MicroBatch(NamedTuple):
    input_ids: torch.Tensor  # [1, t] long
    position_ids: torch.Tensor  # [1, t] long, restarting at 0 per sequence
    cu_seqlens: torch.Tensor  # [n + 1] int32
    max_seqlen: int
    targets: torch.Tensor  # [t] long (0 where there is no next token)
    response_mask: torch.Tensor  # [t] bool: targets[p] is a response token
    sample_indices: tuple[int, ...]  # positions of these sequences in the caller's batch

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[1])


def plan_micro_batches(lengths: Sequence[int], max_tokens: int) -> list[list[int]]:
    """Group sequence indices, in order, into micro-batches of at most `max_tokens` tokens."""
    groups: list[list[int]] = []
    current: list[int] = []
    used = 0
    for i, n in enumerate(lengths):
        if n > max_tokens:
            raise ValueError(
                f"sequence {i} has {n} tokens, more than max_tokens_per_micro_batch="
                f"{max_tokens}; raise max_tokens_per_micro_batch to at least {n}"
            )
        if current and used + n > max_tokens:
            groups.append(current)
            current, used = [], 0
        current.append(i)
        used += n
    if current:
        groups.append(current)
    return groups


def pack(
    tokens: Sequence[Sequence[int]], prompt_lens: Sequence[int], indices: Sequence[int]
) -> MicroBatch:
    """One micro-batch of sequences `indices`; sequence i's response is
    tokens[i][prompt_lens[i]:]."""
    ids, pos, targets, resp, cu = [], [], [], [], [0]
    for i in indices:
        seq, p = list(tokens[i]), int(prompt_lens[i])
        if not 1 <= p <= len(seq):
            raise ValueError(f"sample {i}: prompt_len={p} must be in [1, len(tokens)={len(seq)}]")
        n = len(seq)
        ids.extend(seq)
        pos.extend(range(n))
        targets.extend(seq[1:] + [0])
        # position q predicts token q+1, a response token iff q+1 >= p
        resp.extend([q + 1 >= p and q + 1 < n for q in range(n)])
        cu.append(cu[-1] + n)
    return MicroBatch(
        input_ids=torch.tensor([ids], dtype=torch.long),
        position_ids=torch.tensor([pos], dtype=torch.long),
        cu_seqlens=torch.tensor(cu, dtype=torch.int32),
        max_seqlen=max(b - a for a, b in zip(cu[:-1], cu[1:])),
        targets=torch.tensor(targets, dtype=torch.long),
        response_mask=torch.tensor(resp, dtype=torch.bool),
        sample_indices=tuple(indices),
    )


def pack_all(
    tokens: Sequence[Sequence[int]], prompt_lens: Sequence[int], max_tokens: int
) -> list[MicroBatch]:
    return [
        pack(tokens, prompt_lens, g)
        for g in plan_micro_batches([len(t) for t in tokens], max_tokens)
    ]

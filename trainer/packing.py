"""Pack variable-length sequences, without padding, into micro-batches by a token budget.

A micro-batch is one row of `t` tokens: the sequences laid end to end, with `cu_seqlens`
marking where each starts (megatron's `thd` layout). Attention and RoPE restart at every
boundary, so a packed row computes exactly what the sequences would compute one by one.

Shared prompts (`share_prompts=True`): the samples of a GRPO group have the same prompt, and
under a causal mask a prompt's hidden states do not depend on what follows it. So a prompt
shared by k samples of a micro-batch is laid out once, followed by the k responses; attention
sees each sample as its own sequence (`SharedPrompts`: the prompt's query / key / value rows
repeated in front of each response), so every response row computes exactly what it computes
in its own sequence, while the prompt's projections, MLPs and their backwards run once instead
of k times. With every prompt distinct the layout is the plain one.

Reads: the logit at packed row `read_rows[j]` predicts response token `read_targets[j]`, the
reads in sample order (`sample_indices`), each sample's in token order. A shared prompt's last
row is read once per sample (it predicts every sample's first response token), so `read_rows`
may repeat; `logit_rows` are the distinct read rows, increasing (what `response_rows` selects),
and `read_index` maps each read to its row there (None: the reads are `logit_rows` themselves).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch


class SharedPrompts(NamedTuple):
    """The per-sample layout attention sees when samples of a micro-batch share prompts."""

    positions: torch.Tensor  # [t] long: each packed row's position in its sample
    expand: torch.Tensor  # [t_e] long: the packed row behind each per-sample row
    cu_seqlens: torch.Tensor  # [n + 1] int32: the per-sample layout's sequence bounds
    pick: torch.Tensor  # [t] long: one per-sample row computing each packed row


class MicroBatch(NamedTuple):
    input_ids: torch.Tensor  # [1, t] long
    position_ids: torch.Tensor  # [1, t] long: each row's position in its sample
    cu_seqlens: torch.Tensor  # [pieces + 1] int32: a sequence, or a shared prompt, or a response
    max_seqlen: int  # the longest sample, prompt + response
    read_rows: torch.Tensor  # [n] long: the row predicting each response token
    read_targets: torch.Tensor  # [n] long: that token
    logit_rows: torch.Tensor  # [m] long: the distinct read rows, increasing
    read_index: torch.Tensor | None  # [n] long: each read's place in logit_rows; None: identity
    sample_indices: tuple[int, ...]  # positions of these sequences in the caller's batch
    shared: SharedPrompts | None  # None: no prompt is shared, each sequence is one piece

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[1])

    def reads_of(self, selected: torch.Tensor) -> torch.Tensor:
        """Rows [n, ...] per read from `selected` [m, ...], the model's output at `logit_rows`."""
        if self.read_index is None:
            return selected
        return selected.index_select(0, self.read_index.to(selected.device))


def _check(tokens, prompt_lens, i: int) -> int:
    p = int(prompt_lens[i])
    if not 1 <= p <= len(tokens[i]):
        raise ValueError(f"sample {i}: prompt_len={p} must be in [1, len(tokens)={len(tokens[i])}]")
    return p


def prompt_groups(
    tokens: Sequence[Sequence[int]], prompt_lens: Sequence[int], indices: Sequence[int]
) -> list[list[int]]:
    """`indices` grouped by identical prompt, groups in order of first appearance, members in
    their order."""
    groups: dict[tuple, list[int]] = {}
    for i in indices:
        p = _check(tokens, prompt_lens, i)
        groups.setdefault(tuple(tokens[i][:p]), []).append(i)
    return list(groups.values())


def plan_micro_batches(
    lengths: Sequence[int],
    max_tokens: int,
    prompt_lens: Sequence[int] | None = None,
    groups: Sequence[Sequence[int]] | None = None,
) -> list[list[int]]:
    """Sequence indices, in order (with `groups`: group by group), into micro-batches of at
    most `max_tokens` rows. With `groups` (samples sharing a prompt) a sample costs its
    response, plus its prompt when that is not in the micro-batch yet."""
    if groups is None:
        groups = [[i] for i in range(len(lengths))]
    plans: list[list[int]] = []
    current: list[int] = []
    used = 0
    for members in groups:
        opened = False  # whether the current micro-batch holds this group's prompt
        for i in members:
            n = lengths[i]
            if n > max_tokens:
                raise ValueError(
                    f"sequence {i} has {n} tokens, more than max_tokens_per_micro_batch="
                    f"{max_tokens}; raise max_tokens_per_micro_batch to at least {n}"
                )
            cost = n - int(prompt_lens[i]) if opened else n
            if current and used + cost > max_tokens:
                plans.append(current)
                current, used, cost = [], 0, n
            current.append(i)
            used += cost
            opened = True
    if current:
        plans.append(current)
    return plans


def pack(
    tokens: Sequence[Sequence[int]],
    prompt_lens: Sequence[int],
    indices: Sequence[int],
    share_prompts: bool = False,
) -> MicroBatch:
    """One micro-batch of sequences `indices`; sequence i's response is
    tokens[i][prompt_lens[i]:]. With `share_prompts` a prompt several of them share is laid
    out once, followed by their responses (module doc)."""
    if share_prompts:
        groups = prompt_groups(tokens, prompt_lens, indices)
    else:
        groups = [[i] for i in indices]
    shared_any = any(len(g) > 1 for g in groups)
    ids: list[int] = []
    pos: list[int] = []
    cu = [0]
    read_rows: list[int] = []
    read_targets: list[int] = []
    # only with a shared prompt, the per-sample layout: row r of it computes what packed row
    # expand[r] computes in its own sequence; pick[q] is one per-sample row of packed row q
    expand: list[int] = []
    cu_e = [0]
    pick: list[int] = []
    for members in groups:
        p = _check(tokens, prompt_lens, members[0])  # every member's (`prompt_groups`)
        prompt_start = len(ids)
        ids.extend(tokens[members[0]][:p])
        pos.extend(range(p))
        if shared_any:
            pick.extend(range(cu_e[-1], cu_e[-1] + p))  # the first member's copy of the prompt
        if len(members) > 1:
            cu.append(len(ids))  # the shared prompt is a piece of its own
        for i in members:
            response = list(tokens[i][p:])
            start, r = len(ids), len(response)
            ids.extend(response)
            pos.extend(range(p, p + r))
            if shared_any:
                copy = cu_e[-1]
                expand.extend(range(prompt_start, prompt_start + p))
                expand.extend(range(start, start + r))
                pick.extend(range(copy + p, copy + p + r))
                cu_e.append(copy + p + r)
            if r:
                # the prompt's last row predicts the first response token; each response row
                # but the last predicts the next
                read_rows.append(prompt_start + p - 1)
                read_rows.extend(range(start, start + r - 1))
                read_targets.extend(response)
                if len(members) > 1:
                    cu.append(len(ids))
        if len(members) == 1:
            cu.append(len(ids))
    rows = torch.tensor(read_rows, dtype=torch.long)
    logit_rows, read_index, shared = rows, None, None
    if shared_any:
        logit_rows, read_index = torch.unique(rows, sorted=True, return_inverse=True)
        shared = SharedPrompts(
            positions=torch.tensor(pos, dtype=torch.long),
            expand=torch.tensor(expand, dtype=torch.long),
            cu_seqlens=torch.tensor(cu_e, dtype=torch.int32),
            pick=torch.tensor(pick, dtype=torch.long),
        )
    if not read_rows:  # no response token: the model returns every row (it cannot return
        # none), and nobody reads them
        logit_rows, read_index = torch.arange(len(ids)), rows
    return MicroBatch(
        input_ids=torch.tensor([ids], dtype=torch.long),
        position_ids=torch.tensor([pos], dtype=torch.long),
        cu_seqlens=torch.tensor(cu, dtype=torch.int32),
        max_seqlen=max(len(tokens[i]) for i in indices),
        read_rows=rows,
        read_targets=torch.tensor(read_targets, dtype=torch.long),
        logit_rows=logit_rows,
        read_index=read_index,
        sample_indices=tuple(i for g in groups for i in g),
        shared=shared,
    )


def pack_all(
    tokens: Sequence[Sequence[int]],
    prompt_lens: Sequence[int],
    max_tokens: int,
    share_prompts: bool = False,
) -> list[MicroBatch]:
    lengths = [len(t) for t in tokens]
    groups = None
    if share_prompts:
        groups = prompt_groups(tokens, prompt_lens, range(len(tokens)))
    plans = plan_micro_batches(lengths, max_tokens, prompt_lens, groups)
    return [pack(tokens, prompt_lens, g, share_prompts) for g in plans]

"""Random paged-KV scenes for the kernel tests and the GPU suite: one layer of a pool with K/V
in shuffled pages, and decode metadata laid out as `ModelRunner._decode_metadata` lays it out
(group prefixes are whole pages, suffixes start on a page boundary, padding is page 0 with bias
-inf, query j of a sequence sees its suffix up to and including itself, padding query cells
repeat the sequence's last query)."""

from __future__ import annotations

import torch

from rollout.attention import DecodeMetadata


def random_pool(
    num_kv_heads: int,
    num_pages: int,
    page_size: int,
    head_dim: int,
    dtype: torch.dtype,
    generator: torch.Generator,
    device: str = "cpu",
) -> tuple[torch.Tensor, torch.Tensor]:
    """(k_cache, v_cache) [Hkv, slots, D], random everywhere: reads of padding must be masked,
    not harmless zeros."""
    shape = (num_kv_heads, num_pages * page_size, head_dim)
    k = torch.randn(shape, generator=generator).to(device=device, dtype=dtype)
    v = torch.randn(shape, generator=generator).to(device=device, dtype=dtype)
    return k, v


def _page_rows(rows: list[list[int]], device: str) -> torch.Tensor:
    width = max((len(r) for r in rows), default=0)
    return (
        torch.tensor([r + [0] * (width - len(r)) for r in rows], dtype=torch.int64)
        .view(len(rows), width)
        .to(device)
    )


def cascade_metadata(
    groups: list[tuple[int, list[int]]],
    page_size: int,
    num_pages: int,
    generator: torch.Generator,
    *,
    num_queries: list[list[int]] | None = None,
    device: str = "cpu",
) -> DecodeMetadata:
    """groups: (prefix pages, [suffix tokens already in the pool, per member]) per group;
    num_queries: query tokens per member (default 1), so a member's suffix holds
    computed + queries tokens. Pages are drawn without replacement from a random permutation."""
    num_queries = num_queries or [[1] * len(members) for _, members in groups]
    perm = torch.randperm(num_pages, generator=generator).tolist()

    def take(n):
        return [perm.pop() for _ in range(n)]

    group_size = max(len(members) for _, members in groups)
    width_q = max(max(qs) for qs in num_queries)
    prefix_rows, prefix_lens, suffix_rows, limits, member_index, counts = [], [], [], [], [], []
    for g, ((prefix, computed), queries) in enumerate(zip(groups, num_queries)):
        prefix_rows.append(take(prefix))
        prefix_lens.append(prefix * page_size)
        for m, (c, nq) in enumerate(zip(computed, queries)):
            assert nq >= 1
            suffix_rows.append(take(-(-(c + nq) // page_size)))
            limits.append([c + min(j, nq - 1) + 1 for j in range(width_q)])
            member_index.append(g * group_size + m)
            counts.append(nq)
    prefix_pages = _page_rows(prefix_rows, device)
    prefix_bias = torch.zeros(len(groups), prefix_pages.shape[1] * page_size, device=device)
    prefix_bias.masked_fill_(
        torch.arange(prefix_bias.shape[1], device=device)
        >= torch.tensor(prefix_lens, device=device).unsqueeze(-1),
        float("-inf"),
    )
    suffix_pages = _page_rows(suffix_rows, device)
    width = suffix_pages.shape[1] * page_size
    suffix_bias = torch.zeros(len(suffix_rows), width_q, width, device=device)
    suffix_bias.masked_fill_(
        torch.arange(width, device=device) >= torch.tensor(limits, device=device).unsqueeze(-1),
        float("-inf"),
    )
    starts = torch.tensor([0, *counts[:-1]]).cumsum(0)
    j = torch.minimum(torch.arange(width_q), torch.tensor(counts).unsqueeze(-1) - 1)
    query_index = (starts.unsqueeze(-1) + j).reshape(-1)
    token_cell = torch.cat([i * width_q + torch.arange(n) for i, n in enumerate(counts)])
    return DecodeMetadata(
        prefix_pages,
        prefix_bias,
        torch.tensor(member_index, device=device),
        group_size,
        suffix_pages,
        suffix_bias,
        query_index.to(device),
        token_cell.to(device),
    )


def plain_metadata(page_table: torch.Tensor, lengths: list[int], page_size: int) -> DecodeMetadata:
    """One query per sequence over its own pages, as a DecodeMetadata with no shared prefix (every
    sequence a group of its own): the torch reference then computes plain paged attention."""
    num_seqs = page_table.shape[0]
    device = page_table.device
    width = page_table.shape[1] * page_size
    bias = torch.zeros(num_seqs, 1, width, device=device)
    bias.masked_fill_(
        torch.arange(width, device=device) >= torch.tensor(lengths, device=device).view(-1, 1, 1),
        float("-inf"),
    )
    rows = torch.arange(num_seqs, device=device)
    return DecodeMetadata(
        torch.zeros(num_seqs, 0, dtype=torch.int64, device=device),
        torch.zeros(num_seqs, 0, device=device),
        rows,
        1,
        page_table,
        bias,
        rows,
        rows,
    )

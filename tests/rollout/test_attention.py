"""Shared-prefix (cascade) decode attention and the prefill path against a naive per-sequence
softmax attention written out with explicit loops."""

import dataclasses
import math

import pytest
import torch

from rollout.attention import (
    AttentionMetadata,
    DecodeMetadata,
    PrefillSegment,
    TorchAttention,
    _gather,
    attend_after_prefix,
    cascade_decode_attention,
    cascade_decode_attention_flash,
    cascade_decode_attention_matmul,
)
from rollout.kv_pool import KVPool


def naive_attention(q, keys, values):
    """q [H, D]; keys/values [L, Hkv, D] -> [H, D], GQA: head h reads kv head h // (H / Hkv)."""
    num_heads, num_kv = q.shape[0], keys.shape[1]
    out = torch.empty_like(q)
    for h in range(num_heads):
        kv = h // (num_heads // num_kv)
        scores = keys[:, kv] @ q[h] / math.sqrt(q.shape[-1])
        out[h] = torch.softmax(scores.double(), 0).float() @ values[:, kv]
    return out


def context_of(cache, pages, length, page_size):
    slots = torch.tensor(
        [p * page_size + i for p in pages for i in range(page_size)][:length], dtype=torch.int64
    )
    return cache[:, slots].transpose(0, 1)  # [L, Hkv, D]


KERNELS = {"flash": cascade_decode_attention_flash, "matmul": cascade_decode_attention_matmul}


def run_kernel(name, q, k_cache, v_cache, meta, page_size):
    """One of the two implementations behind `cascade_decode_attention`, on gathered K/V."""
    suffix = tuple(_gather(c, meta.suffix_pages, page_size) for c in (k_cache, v_cache))
    prefix = tuple(_gather(c, meta.prefix_pages, page_size) for c in (k_cache, v_cache))
    return KERNELS[name](q, meta, suffix, prefix if meta.prefix_pages.shape[1] else None)


def cascade_case(page_size, dtype=torch.float32, seed=0, head_dim=8):
    """q, caches, metadata and the per-sequence layout of the mixed case below."""
    g = torch.Generator().manual_seed(seed)
    num_kv, num_heads, num_pages = 2, 6, 64
    k_cache = torch.randn(num_kv, num_pages * page_size, head_dim, generator=g, dtype=dtype)
    v_cache = torch.randn(num_kv, num_pages * page_size, head_dim, generator=g, dtype=dtype)
    perm = torch.randperm(num_pages, generator=g).tolist()

    def take(n):
        return [perm.pop() for _ in range(n)]

    # Three groups: 3 members sharing 2 prefix pages, 1 member with 1 prefix page, and a
    # sequence with no shared prefix at all; suffixes of different lengths; some sequences
    # verify several query tokens at once (speculation), causal among themselves.
    prefixes = [take(2), take(1), []]
    members = [[0, 1, 2], [3], [4]]
    suffix_lens = [
        1,
        2 * page_size + 1,
        page_size,
        3,
        2 * page_size + 4,
    ]  # after this step's queries
    queries = [1, 3, 1, 2, 4]
    suffix_pages = [take(-(-n // page_size)) for n in suffix_lens]
    group_size, width_q = 3, max(queries)
    member_index = [0] * 5
    for gi, ms in enumerate(members):
        for m, i in enumerate(ms):
            member_index[i] = gi * group_size + m

    def pad(rows):
        width = max(len(r) for r in rows)
        return torch.tensor([r + [0] * (width - len(r)) for r in rows])

    def bias(limits, width):
        b = torch.zeros(*limits.shape, width)
        return b.masked_fill_(torch.arange(width) >= limits.unsqueeze(-1), float("-inf"))

    prefix_pages = pad(prefixes)
    prefix_bias = bias(
        torch.tensor([len(p) * page_size for p in prefixes]), prefix_pages.shape[1] * page_size
    )
    suf_pages = pad(suffix_pages)
    starts = [sum(queries[:i]) for i in range(5)]
    cells, limits, query_index = [], [], []
    for i, (n, q) in enumerate(zip(suffix_lens, queries)):
        limits.append([n - q + min(j, q - 1) + 1 for j in range(width_q)])
        query_index += [starts[i] + min(j, q - 1) for j in range(width_q)]
        cells += [i * width_q + j for j in range(q)]
    meta = DecodeMetadata(
        prefix_pages,
        prefix_bias,
        torch.tensor(member_index),
        group_size,
        suf_pages,
        bias(torch.tensor(limits), suf_pages.shape[1] * page_size),
        torch.tensor(query_index),
        torch.tensor(cells),
    )
    q = torch.randn(sum(queries), num_heads, head_dim, generator=g, dtype=dtype)
    layout = (prefixes, members, suffix_pages, suffix_lens, queries, starts)
    return q, k_cache, v_cache, meta, layout


@pytest.mark.parametrize("kernel", [None, *KERNELS])
@pytest.mark.parametrize("page_size", [1, 4])
def test_cascade_matches_naive(page_size, kernel):
    q, k_cache, v_cache, meta, layout = cascade_case(page_size)
    prefixes, members, suffix_pages, suffix_lens, queries, starts = layout
    if kernel is None:  # the dispatcher (the C kernel on CPU in float32), gathering itself
        got = cascade_decode_attention(q, k_cache, v_cache, meta, page_size)
    else:
        got = run_kernel(kernel, q, k_cache, v_cache, meta, page_size)
    for gi, ms in enumerate(members):
        for i in ms:
            keys = torch.cat(
                [
                    context_of(k_cache, prefixes[gi], len(prefixes[gi]) * page_size, page_size),
                    context_of(k_cache, suffix_pages[i], suffix_lens[i], page_size),
                ]
            )
            values = torch.cat(
                [
                    context_of(v_cache, prefixes[gi], len(prefixes[gi]) * page_size, page_size),
                    context_of(v_cache, suffix_pages[i], suffix_lens[i], page_size),
                ]
            )
            for j in range(queries[i]):
                visible = len(keys) - queries[i] + j + 1
                row = starts[i] + j
                torch.testing.assert_close(
                    got[row],
                    naive_attention(q[row], keys[:visible], values[:visible]),
                    atol=1e-5,
                    rtol=1e-5,
                )


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_flash_equals_matmul_in_float64(seed):
    """The CPU flash path (two fused kernels merged by log-sum-exp) against the matmul path (one
    softmax over prefix ++ suffix), in float64: equal to rounding (groups with and without a
    shared prefix, several queries per sequence)."""
    q, k_cache, v_cache, meta, _ = cascade_case(4, torch.float64, seed)
    flash = run_kernel("flash", q, k_cache, v_cache, meta, 4)
    matmul = run_kernel("matmul", q, k_cache, v_cache, meta, 4)
    assert flash.dtype == torch.float64
    torch.testing.assert_close(flash, matmul, atol=1e-13, rtol=1e-13)


def slot_pool(num_slots: int, num_kv_heads: int, head_dim: int) -> KVPool:
    """A one-layer float32 CPU pool of one-slot pages (prefill tests)."""
    return KVPool(
        num_layers=1,
        num_pages=num_slots,
        page_size=1,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        dtype=torch.float32,
        device=torch.device("cpu"),
    )


def test_prefill_segment_is_causal_over_cached_prefix():
    g = torch.Generator().manual_seed(1)
    pool = slot_pool(16, num_kv_heads=1, head_dim=4)
    attn = TorchAttention(pool)
    cached = torch.tensor([3, 7, 1])  # prefix already in the pool
    pool.k[0][:, cached] = torch.randn(1, 3, 4, generator=g)
    pool.v[0][:, cached] = torch.randn(1, 3, 4, generator=g)
    new_slots = torch.tensor([9, 2])
    context = torch.cat([cached, new_slots])
    meta = AttentionMetadata(new_slots, None, (PrefillSegment(0, 2, context, prefix_len=3),))
    q, k, v = (
        torch.randn(2, 2, 4, generator=g),
        torch.randn(2, 1, 4, generator=g),
        torch.randn(2, 1, 4, generator=g),
    )
    out = attn.forward(0, q, k, v, meta)
    keys = pool.k[0][:, context].transpose(0, 1)
    values = pool.v[0][:, context].transpose(0, 1)
    for i in range(2):
        visible = 3 + i + 1
        torch.testing.assert_close(
            out[i], naive_attention(q[i], keys[:visible], values[:visible]), atol=1e-5, rtol=1e-5
        )
    torch.testing.assert_close(pool.k[0][:, new_slots].transpose(0, 1), k)  # new K/V were stored


def test_prefill_chunks_without_a_prefix_are_plain_causal():
    """Chunks with no cached prefix (prefix_len 0, as `ModelRunner.prepare` gives them) attend
    causally over their own new tokens; adjacent ones of one length run as one batched call.
    Mixed here with a chunk after a cached prefix and one of another length; each
    query checked against attention over exactly the keys it may see."""
    g = torch.Generator().manual_seed(2)
    pool = slot_pool(32, num_kv_heads=2, head_dim=8)
    cached = torch.tensor([30, 31])  # the prefixed chunk's prefix, already in the pool
    pool.k[0][:, cached] = torch.randn(2, 2, 8, generator=g)
    pool.v[0][:, cached] = torch.randn(2, 2, 8, generator=g)
    lengths, prefixed = [3, 3, 3, 2, 4], 3  # chunk 3 follows the cached prefix
    slots = torch.randperm(28, generator=g)[: sum(lengths)]
    segments, starts = [], [0]
    for c, n in enumerate(lengths):
        own = slots[starts[-1] : starts[-1] + n]
        if c == prefixed:
            context = torch.cat([cached, own])
            segments.append(PrefillSegment(starts[-1], n, context, prefix_len=2))
        else:
            segments.append(PrefillSegment(starts[-1], n, own))
        starts.append(starts[-1] + n)
    meta = AttentionMetadata(slots, None, tuple(segments))
    q = torch.randn(len(slots), 4, 8, generator=g)
    k, v = torch.randn(len(slots), 2, 8, generator=g), torch.randn(len(slots), 2, 8, generator=g)
    out = TorchAttention(pool).forward(0, q, k, v, meta)
    for c, seg in enumerate(segments):
        keys = pool.k[0][:, seg.context_slots].transpose(0, 1)
        values = pool.v[0][:, seg.context_slots].transpose(0, 1)
        before = 2 if c == prefixed else 0
        for i in range(seg.num_new):
            visible = before + i + 1
            want = naive_attention(q[seg.token_start + i], keys[:visible], values[:visible])
            torch.testing.assert_close(out[seg.token_start + i], want, atol=1e-5, rtol=1e-5)


def in_order_case(page_size, seed, dtype=torch.float64):
    """Two groups of three members, in order (member_index = arange), one query each: the GRPO
    layout the flash path serves without scatters (`DecodeMetadata.members_in_order`)."""
    g = torch.Generator().manual_seed(seed)
    num_kv, num_heads, head_dim, num_pages = 2, 6, 8, 64
    k_cache = torch.randn(num_kv, num_pages * page_size, head_dim, generator=g, dtype=dtype)
    v_cache = torch.randn(num_kv, num_pages * page_size, head_dim, generator=g, dtype=dtype)
    perm = torch.randperm(num_pages, generator=g).tolist()
    prefix_pages = torch.tensor([[perm.pop() for _ in range(2)], [perm.pop(), 0]])
    prefix_lens = torch.tensor([[2 * page_size], [page_size]])
    suffix_lens = [1, 3, page_size + 2, 2, 2 * page_size, 5]
    width = -(-max(suffix_lens) // page_size)
    suffix_pages = torch.tensor(
        [
            [perm.pop() for _ in range(-(-n // page_size))] + [0] * (width - -(-n // page_size))
            for n in suffix_lens
        ]
    )

    def bias(limits, columns):
        return torch.zeros(*limits.shape[:-1], columns).masked_fill_(
            torch.arange(columns) >= limits, float("-inf")
        )

    meta = DecodeMetadata(
        prefix_pages,
        bias(prefix_lens, 2 * page_size),
        torch.arange(6),
        3,
        suffix_pages,
        bias(torch.tensor(suffix_lens).view(6, 1, 1), width * page_size),
        torch.arange(6),
        torch.arange(6),
        members_in_order=True,
    )
    q = torch.randn(6, num_heads, head_dim, generator=g, dtype=dtype)
    return q, k_cache, v_cache, meta


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("seed", [0, 1])
def test_members_in_order_equals_the_scatter_path(seed, dtype):
    """`members_in_order` views the sequences as the [G, M] grid; the general path scatters them
    into it and gathers back: the same arithmetic on the same layouts, so bitwise equal (the
    engine's lanes-vs-gather test needs that), and equal to the matmul reference to rounding."""
    q, k_cache, v_cache, meta = in_order_case(4, seed, dtype)
    in_order = run_kernel("flash", q, k_cache, v_cache, meta, 4)
    scattered = run_kernel(
        "flash", q, k_cache, v_cache, dataclasses.replace(meta, members_in_order=False), 4
    )
    assert torch.equal(in_order, scattered)
    matmul = run_kernel("matmul", q, k_cache, v_cache, meta, 4)
    bound = 1e-13 if dtype == torch.float64 else 1e-5
    torch.testing.assert_close(in_order, matmul, atol=bound, rtol=bound)


def prefix_chunk_case(num_heads, num_kv, seed):
    """A float64 pool holding a context of 7 cached + 5 new tokens at scattered slots, and the
    chunk's queries [1, H, 5, D]."""
    g = torch.Generator().manual_seed(seed)
    k_cache = torch.randn(num_kv, 40, 16, generator=g, dtype=torch.float64)
    v_cache = torch.randn(num_kv, 40, 16, generator=g, dtype=torch.float64)
    slots = torch.randperm(40, generator=g)[:12]
    queries = torch.randn(1, num_heads, 5, 16, generator=g, dtype=torch.float64)
    return queries, k_cache, v_cache, slots


def reference_after_prefix(queries, k_cache, v_cache, slots):
    """Softmax attention written out: query i of the chunk (the context's last n tokens) sees
    context positions 0 .. C - n + i; head h reads K/V head h // (H / Hkv)."""
    num_heads, n, dim = queries.shape[1:]
    num_kv, context = k_cache.shape[0], slots.shape[0]
    out = torch.empty_like(queries)
    for h in range(num_heads):
        kv = h // (num_heads // num_kv)
        keys, values = k_cache[kv, slots], v_cache[kv, slots]
        for i in range(n):
            visible = context - n + i + 1
            scores = keys[:visible] @ queries[0, h, i] / math.sqrt(dim)
            out[0, h, i] = torch.softmax(scores, 0) @ values[:visible]
    return out


@pytest.mark.parametrize("num_heads, num_kv", [(6, 2), (4, 4), (28, 4)])
@pytest.mark.parametrize("per_head_kv", [True, False])
def test_attention_after_a_cached_prefix_is_causal_from_the_end(num_heads, num_kv, per_head_kv):
    """Both ways of attending a chunk after its cached prefix (the one SDPA's fused GPU kernels
    take, and the CPU one) equal attention written out, in float64."""
    case = prefix_chunk_case(num_heads, num_kv, seed=num_heads)
    out = attend_after_prefix(*case, per_head_kv=per_head_kv)
    torch.testing.assert_close(out, reference_after_prefix(*case), rtol=0, atol=1e-12)


def test_attention_after_a_cached_prefix_calls_sdpa_as_fused_kernels_accept(monkeypatch):
    """The GPU way's SDPA call: the memory-efficient kernel refuses GQA (fewer K/V heads than
    query heads) and flash refuses any mask tensor, and a boolean mask with `enable_gqa` fits
    neither (the math kernel, [H, n, C] scores). So: as many K/V heads as query heads, no
    `enable_gqa`, and the causal offset as a lower-right `CausalBias`, no mask tensor."""
    from torch.nn.attention.bias import CausalBias, CausalVariant

    calls = []

    def spy(query, key, value, attn_mask=None, **kwargs):  # records the call, computes nothing
        calls.append((query.shape, key.shape, value.shape, attn_mask, kwargs))
        return torch.empty_like(query)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    queries, k_cache, v_cache, slots = prefix_chunk_case(28, 4, seed=0)
    attend_after_prefix(queries, k_cache, v_cache, slots, per_head_kv=True)
    # the GPU way is the default off the CPU
    on_meta = (x.to("meta") for x in (queries, k_cache, v_cache, slots))
    attend_after_prefix(*on_meta)
    assert len(calls) == 2
    for query_shape, key_shape, value_shape, mask, kwargs in calls:
        assert key_shape[1] == value_shape[1] == query_shape[1] == 28
        assert not kwargs.get("enable_gqa", False) and not kwargs.get("is_causal", False)
        assert isinstance(mask, CausalBias) and mask.variant == CausalVariant.LOWER_RIGHT
        assert (mask.seq_len_q, mask.seq_len_kv) == (5, 12)

"""Shared-prefix (cascade) decode attention and the prefill path against a naive per-sequence
softmax attention written out with explicit loops."""

import math

import pytest
import torch

from rollout.attention import AttentionMetadata, DecodeMetadata, PrefillSegment, TorchAttention, cascade_decode_attention
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
    slots = torch.tensor([p * page_size + i for p in pages for i in range(page_size)][:length], dtype=torch.int64)
    return cache[:, slots].transpose(0, 1)      # [L, Hkv, D]


@pytest.mark.parametrize("page_size", [1, 4])
def test_cascade_matches_naive(page_size):
    g = torch.Generator().manual_seed(0)
    num_kv, num_heads, head_dim, num_pages = 2, 6, 8, 64
    k_cache = torch.randn(num_kv, num_pages * page_size, head_dim, generator=g)
    v_cache = torch.randn(num_kv, num_pages * page_size, head_dim, generator=g)
    perm = torch.randperm(num_pages, generator=g).tolist()
    take = lambda n: [perm.pop() for _ in range(n)]
    # Three groups: 3 members sharing 2 prefix pages, 1 member with 1 prefix page, and a
    # sequence with no shared prefix at all; suffixes of different lengths.
    prefixes = [take(2), take(1), []]
    members = [[0, 1, 2], [3], [4]]
    suffix_lens = [1, 2 * page_size + 1, page_size, 3, 2 * page_size]
    suffix_pages = [take(-(-n // page_size)) for n in suffix_lens]
    group_size = 3
    member_index = [0] * 5
    for gi, ms in enumerate(members):
        for m, i in enumerate(ms):
            member_index[i] = gi * group_size + m

    def pad(rows, lens):
        width = max(len(r) for r in rows)
        pages = torch.tensor([r + [0] * (width - len(r)) for r in rows])
        bias = torch.zeros(len(rows), width * page_size)
        for i, n in enumerate(lens):
            bias[i, n:] = float("-inf")
        return pages, bias

    prefix_pages, prefix_bias = pad(prefixes, [len(p) * page_size for p in prefixes])
    suf_pages, suf_bias = pad(suffix_pages, suffix_lens)
    meta = DecodeMetadata(prefix_pages, prefix_bias, torch.tensor(member_index), group_size, suf_pages, suf_bias)
    q = torch.randn(5, num_heads, head_dim, generator=g)
    got = cascade_decode_attention(q, k_cache, v_cache, meta, page_size)
    for gi, ms in enumerate(members):
        for i in ms:
            keys = torch.cat([context_of(k_cache, prefixes[gi], len(prefixes[gi]) * page_size, page_size),
                              context_of(k_cache, suffix_pages[i], suffix_lens[i], page_size)])
            values = torch.cat([context_of(v_cache, prefixes[gi], len(prefixes[gi]) * page_size, page_size),
                                context_of(v_cache, suffix_pages[i], suffix_lens[i], page_size)])
            torch.testing.assert_close(got[i], naive_attention(q[i], keys, values), atol=1e-5, rtol=1e-5)


def test_prefill_segment_is_causal_over_cached_prefix():
    g = torch.Generator().manual_seed(1)
    pool = KVPool(num_layers=1, num_pages=16, page_size=1, num_kv_heads=1, head_dim=4,
                  dtype=torch.float32, device=torch.device("cpu"))
    attn = TorchAttention(pool)
    cached = torch.tensor([3, 7, 1])              # prefix already in the pool
    pool.k[0][:, cached] = torch.randn(1, 3, 4, generator=g)
    pool.v[0][:, cached] = torch.randn(1, 3, 4, generator=g)
    new_slots = torch.tensor([9, 2])
    context = torch.cat([cached, new_slots])
    mask = torch.arange(5).unsqueeze(0) <= torch.tensor([[3], [4]])
    meta = AttentionMetadata(new_slots, None, (PrefillSegment(0, 2, context, mask),))
    q, k, v = (torch.randn(2, 2, 4, generator=g), torch.randn(2, 1, 4, generator=g), torch.randn(2, 1, 4, generator=g))
    out = attn.forward(0, q, k, v, meta)
    keys = pool.k[0][:, context].transpose(0, 1)
    values = pool.v[0][:, context].transpose(0, 1)
    for i in range(2):
        visible = 3 + i + 1
        torch.testing.assert_close(out[i], naive_attention(q[i], keys[:visible], values[:visible]), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(pool.k[0][:, new_slots].transpose(0, 1), k)   # new K/V were stored

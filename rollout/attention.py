"""Paged attention over the KV pool.

One engine step runs a *mixed* batch: first the decode tokens (one per running sequence), then
the prefill chunks. `AttentionMetadata` describes where each token's K/V goes and which slots
each query may read; it is built once per step and shared by all layers.

The backend is the seam for GPU kernels: `TorchAttention` is the reference implementation on any
device (plain torch, `scaled_dot_product_attention`); a Triton backend computing the same function
plugs in behind the same `forward`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from rollout.kv_pool import KVPool


@dataclass(frozen=True)
class PrefillSegment:
    token_start: int          # first row of this chunk in the flat batch
    num_new: int              # tokens computed in this chunk
    context_slots: torch.Tensor  # [C] slots of the whole visible context (cached prefix + chunk)
    mask: torch.Tensor        # [num_new, C] bool, True = may attend (causal, offset by the prefix)


@dataclass(frozen=True)
class AttentionMetadata:
    out_slots: torch.Tensor       # [T] where each token's K/V is written
    num_decode: int               # the first `num_decode` tokens are decode tokens
    decode_slots: torch.Tensor    # [D, S] context slots per decode sequence, padded with slot 0
    decode_mask: torch.Tensor     # [D, 1, 1, S] bool, True = real slot
    prefill: tuple[PrefillSegment, ...]


class TorchAttention:
    """Reference paged attention: store the new K/V, gather each query's context, SDPA."""

    def __init__(self, pool: KVPool):
        self.pool = pool

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        """q: [T, H, D]; k, v: [T, Hkv, D] for the batch's new tokens -> [T, H, D]."""
        k_cache, v_cache = self.pool.k[layer], self.pool.v[layer]
        k_cache.index_copy_(0, meta.out_slots, k)
        v_cache.index_copy_(0, meta.out_slots, v)
        out = torch.empty_like(q)
        num_decode = meta.num_decode
        if num_decode:
            # [D, S, Hkv, D] -> [D, Hkv, S, D]
            keys = k_cache[meta.decode_slots].transpose(1, 2)
            values = v_cache[meta.decode_slots].transpose(1, 2)
            out[:num_decode] = F.scaled_dot_product_attention(
                q[:num_decode].unsqueeze(2), keys, values, attn_mask=meta.decode_mask, enable_gqa=True
            ).squeeze(2)
        for seg in meta.prefill:
            rows = slice(seg.token_start, seg.token_start + seg.num_new)
            keys = k_cache[seg.context_slots].transpose(0, 1).unsqueeze(0)      # [1, Hkv, C, D]
            values = v_cache[seg.context_slots].transpose(0, 1).unsqueeze(0)
            queries = q[rows].transpose(0, 1).unsqueeze(0)                      # [1, H, n, D]
            out[rows] = F.scaled_dot_product_attention(
                queries, keys, values, attn_mask=seg.mask, enable_gqa=True
            ).squeeze(0).transpose(0, 1)
        return out

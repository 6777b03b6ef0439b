"""Core attention for megatron's SelfAttention on `F.scaled_dot_product_attention`.

megatron-core's local `DotProductAttention` rejects packed (`thd`) sequences and expects CUDA
buffers; Transformer Engine's needs CUDA. This module computes the same causal softmax
attention on any device, for both layouts megatron hands to a core attention:

* `bshd` (unpacked): query [s, b, heads, d], key/value [s, b, groups, d];
* `thd` (packed, `packed_seq_params.qkv_format == "thd"`): query [t, heads, d] with the
  sequences laid end to end, `cu_seqlens_q` marking the boundaries. Each sequence attends only
  to itself (a causal block per sequence), so packing never leaks across samples. Sequences of
  similar length (the same power-of-two bucket) are padded to the bucket's longest and attended
  in one batched call: a padding key is masked out for every query (weight exactly 0), a
  padding query is computed and dropped. Bucketing keeps padding under 4x the real work however
  mixed the lengths; one call per sequence was most of a small model's training step. A
  bucket of consecutive sequences of one length (a fixed-length RL batch) needs no padding:
  it is a view of the packed rows with a plain causal mask, so neither the gather nor its
  backward's scatter-add runs.

Grouped-query attention: query head h uses key/value group h // (heads / groups), the same
assignment as megatron's `repeat_interleave` and HF's `repeat_kv`.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.nn.functional as F
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from torch.nn.attention import SDPBackend, sdpa_kernel


class SDPACoreAttention(MegatronModule):
    def __init__(
        self,
        config,
        layer_number,
        attn_mask_type,
        attention_type,
        attention_dropout=None,
        softmax_scale=None,
        cp_comm_type=None,
        pg_collection=None,
    ):
        super().__init__(config=config)
        if config.context_parallel_size != 1:
            raise NotImplementedError("SDPACoreAttention does not support context parallelism")
        if attn_mask_type not in (AttnMaskType.causal, AttnMaskType.padding_causal):
            raise NotImplementedError(
                f"SDPACoreAttention supports causal masks only, got {attn_mask_type}"
            )
        dropout = config.attention_dropout if attention_dropout is None else attention_dropout
        if dropout:
            raise NotImplementedError(
                "SDPACoreAttention has no attention dropout; set attention_dropout=0"
            )
        self.softmax_scale = (
            softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(config.kv_channels)
        )

    def forward(
        self,
        query,
        key,
        value,
        attention_mask,
        attn_mask_type=None,
        attention_bias=None,
        packed_seq_params=None,
    ):
        if attention_bias is not None:
            raise NotImplementedError("SDPACoreAttention does not take an attention bias")
        if packed_seq_params is not None and packed_seq_params.qkv_format == "thd":
            if attention_mask is not None:
                raise NotImplementedError(
                    "packed sequences carry their boundaries in cu_seqlens; "
                    "pass attention_mask=None"
                )
            out = packed_causal_attention(
                query, key, value, packed_seq_params.cu_seqlens_q, self.softmax_scale
            )  # [t, heads, d]
            return out.reshape(out.size(0), -1)  # attention.py reshapes to [t, 1, h]
        if attention_mask is not None:
            raise NotImplementedError(
                "SDPACoreAttention applies the causal mask itself; pass attention_mask=None"
            )
        # [s, b, n, d] -> [b, n, s, d]
        q, k, v = (x.permute(1, 2, 0, 3) for x in (query, key, value))
        out = causal_attention(q, k, v, self.softmax_scale)  # [b, heads, s, d]
        s, b = query.size(0), query.size(1)
        return out.permute(2, 0, 1, 3).reshape(s, b, -1)


def causal_attention(q, k, v, scale: float, mask=None):
    """q [b, heads, s, d], k/v [b, groups, s, d] -> [b, heads, s, d], causal; `mask`
    [b, 1, s, s] bool (True = attend) replaces the plain causal mask when given."""
    causal = mask is None
    if q.device.type == "cpu":
        # On CPU the default (flash) kernel's blocked online softmax is measurably less exact
        # than the plain one: on a GRPO-sharpened model its log-probs were 1.1e-5 from an fp64
        # reference against 4.7e-6 with the math kernel (the engine's: 5.1e-6), which breaks
        # the engine-vs-trainer 1e-5 budget. Sequences here are short; exactness wins.
        with sdpa_kernel(SDPBackend.MATH):
            return F.scaled_dot_product_attention(
                q,
                k,
                v,
                attn_mask=mask,
                is_causal=causal,
                scale=scale,
                enable_gqa=q.size(1) != k.size(1),
            )
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, is_causal=causal, scale=scale, enable_gqa=q.size(1) != k.size(1)
    )


class _Bucket(NamedTuple):
    gather: torch.Tensor  # [B * L] packed row read into each padded position
    mask: torch.Tensor  # [B, 1, L, L] bool, causal and padding keys masked out
    keep: torch.Tensor  # [B * L] bool, the padded positions that are real tokens
    size: int  # B sequences
    longest: int  # L
    # (first, end) packed rows when the bucket is consecutive sequences all L long: then the
    # padded layout is a view of rows first..end (no gather, no scatter in the backward) and
    # the mask is plain causal
    rows: tuple[int, int] | None


class _PackingPlan(NamedTuple):
    buckets: list[_Bucket]
    order: torch.Tensor | None  # output rows (buckets concatenated) -> packed order; None: same


# The plan of the micro-batch being computed: every layer (and a recomputed forward) gets the same
# `cu_seqlens` tensor, so the plan is built once per micro-batch, not once per layer. Holding the
# tensor keeps its identity from being reused; its version counter catches in-place changes.
_last_plan: tuple[torch.Tensor, int, torch.device, _PackingPlan] | None = None


def _packing_plan(cu_seqlens: torch.Tensor, device: torch.device) -> _PackingPlan:
    global _last_plan
    if (
        _last_plan is not None
        and _last_plan[0] is cu_seqlens
        and _last_plan[1] == cu_seqlens._version
        and _last_plan[2] == device
    ):
        return _last_plan[3]
    bounds = cu_seqlens.to("cpu", torch.int64)
    starts, lengths = bounds[:-1], bounds[1:] - bounds[:-1]
    members_of: dict[int, list[int]] = {}
    for i, n in enumerate(lengths.tolist()):
        if n > 0:
            members_of.setdefault((n - 1).bit_length(), []).append(i)
    buckets, rows = [], []
    for members in members_of.values():
        idx = torch.tensor(members)
        lens, first = lengths[idx], starts[idx]
        longest = int(lens.max())
        offsets = torch.arange(longest)
        valid = offsets[None, :] < lens[:, None]  # [B, L]
        # padding positions repeat the sequence's last token: finite, and never read back
        gather = first[:, None] + torch.minimum(offsets[None, :], lens[:, None] - 1)
        causal = torch.ones(longest, longest, dtype=torch.bool).tril()
        mask = (causal[None] & valid[:, None, :]).unsqueeze(1)
        dense = bool((lens == longest).all()) and members == list(
            range(members[0], members[0] + len(members))
        )
        start = int(first[0])
        buckets.append(
            _Bucket(
                gather.reshape(-1).to(device),
                mask.to(device),
                valid.reshape(-1).to(device),
                len(members),
                longest,
                (start, start + len(members) * longest) if dense else None,
            )
        )
        rows.append(gather.reshape(-1)[valid.reshape(-1)])
    # back to packed order: rows lists, per bucket, the packed position of each output row
    rows_cat = torch.cat(rows)
    in_order = bool((rows_cat == torch.arange(rows_cat.numel())).all())
    plan = _PackingPlan(buckets, None if in_order else torch.argsort(rows_cat).to(device))
    _last_plan = (cu_seqlens, cu_seqlens._version, device, plan)
    return plan


def packed_causal_attention(query, key, value, cu_seqlens, scale: float):
    """query [t, heads, d], key/value [t, groups, d], sequences laid end to end at
    `cu_seqlens` -> [t, heads, d], each sequence attending causally to itself only."""
    plan = _packing_plan(cu_seqlens, query.device)
    pieces = []
    for b in plan.buckets:
        if b.rows is not None:  # equal lengths, consecutive: a view, plain causal mask
            first, end = b.rows
            q, k, v = (
                x[first:end].view(b.size, b.longest, *x.shape[1:]).transpose(1, 2)
                for x in (query, key, value)
            )
            out = causal_attention(q, k, v, scale).transpose(1, 2)  # [B, L, heads, d]
            pieces.append(out.reshape(-1, *out.shape[2:]))
            continue
        q, k, v = (
            x.index_select(0, b.gather).view(b.size, b.longest, *x.shape[1:]).transpose(1, 2)
            for x in (query, key, value)
        )  # [B, n, L, d]
        out = causal_attention(q, k, v, scale, b.mask).transpose(1, 2)  # [B, L, heads, d]
        pieces.append(out.reshape(-1, *out.shape[2:])[b.keep])
    out = pieces[0] if len(pieces) == 1 else torch.cat(pieces)
    return out if plan.order is None else out.index_select(0, plan.order)

"""Core attention for megatron's SelfAttention on `F.scaled_dot_product_attention`.

megatron-core's local `DotProductAttention` rejects packed (`thd`) sequences and expects CUDA
buffers; Transformer Engine's needs CUDA. This module computes the same causal softmax
attention on any device, for both layouts megatron hands to a core attention:

* `bshd` (unpacked): query [s, b, heads, d], key/value [s, b, groups, d];
* `thd` (packed, `packed_seq_params.qkv_format == "thd"`): query [t, heads, d] with the
  sequences laid end to end, `cu_seqlens_q` marking the boundaries. Each sequence attends only
  to itself (a causal block per sequence), so packing never leaks across samples. Sequences of
  similar length (the same power-of-two bucket) are right-padded with zero rows to the bucket's
  longest and attended in one batched causal call: no real query sees a padding key (it comes
  after every real one), a padding query is computed and dropped. Bucketing keeps padding under
  4x the real work however mixed the lengths; one call per sequence was most of a small model's
  training step. Padding and unpadding move each row once, and their backwards do the same
  (no scatter-add). When every bucket is consecutive sequences of one length (a fixed-length
  RL batch) the padded layout is the packed one: nothing moves at all.

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

from trainer import shared_prompts
from trainer.packing import SharedPrompts
from trainer.row_gather import gather_rows, scatter_rows


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
            cu = packed_seq_params.cu_seqlens_q
            layout = shared_prompts.layout_for(cu)
            if layout is None:
                out = packed_causal_attention(query, key, value, cu, self.softmax_scale)
            else:
                out = shared_prompt_attention(query, key, value, layout, self.softmax_scale)
            # out: [t, heads, d]
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


def causal_attention(q, k, v, scale: float):
    """q [b, heads, s, d], k/v [b, groups, s, d] -> [b, heads, s, d], causal."""
    gqa = q.size(1) != k.size(1)
    if q.device.type == "cpu" and q.dtype != torch.float32:
        # float64 (the exactness path: engine vs trainer within 1e-10) takes the plain kernel, whose
        # one-pass softmax rounds like the references', and so does bfloat16 (its measured
        # engine-vs-trainer bounds are the plain kernel's); float32 takes the default, the
        # blocked flash kernel, which skips the masked half of every causal block where the
        # plain one materializes and softmaxes full [s, s] score matrices
        with sdpa_kernel(SDPBackend.MATH):
            return F.scaled_dot_product_attention(
                q, k, v, is_causal=True, scale=scale, enable_gqa=gqa
            )
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=gqa)


class _Bucket(NamedTuple):
    start: int  # first row of the bucket in the padded layout
    size: int  # B sequences
    longest: int  # L: each sequence is right-padded to L rows


class _PackingPlan(NamedTuple):
    buckets: list[_Bucket]
    rows: int  # rows of the padded layout (the buckets' B * L, end to end)
    # [t] the padded row of each packed row; None when the padded layout is the packed one
    # (every bucket consecutive sequences of one length, in order: a fixed-length RL batch)
    dest: torch.Tensor | None


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
    buckets, dest = [], torch.empty(int(bounds[-1]), dtype=torch.int64)
    rows = 0
    for members in members_of.values():
        longest = int(lengths[members].max())
        buckets.append(_Bucket(rows, len(members), longest))
        for j, i in enumerate(members):
            first, n = int(starts[i]), int(lengths[i])
            dest[first : first + n] = torch.arange(n) + rows + j * longest
        rows += len(members) * longest
    identity = rows == dest.numel() and bool((dest == torch.arange(rows)).all())
    plan = _PackingPlan(buckets, rows, None if identity else dest.to(device))
    _last_plan = (cu_seqlens, cu_seqlens._version, device, plan)
    return plan


def packed_causal_attention(query, key, value, cu_seqlens, scale: float):
    """query [t, heads, d], key/value [t, groups, d], sequences laid end to end at
    `cu_seqlens` -> [t, heads, d], each sequence attending causally to itself only.

    Each bucket's sequences are right-padded with zero rows: under the causal mask a real
    query never sees a padding key (it comes after every real one), and a padding query's
    output is dropped, so its gradient (and with it its share of the key / value gradients)
    is exactly 0. No mask beyond the causal one is needed."""
    plan = _packing_plan(cu_seqlens, query.device)
    if plan.dest is not None:
        query, key, value = (scatter_rows(x, plan.dest, plan.rows) for x in (query, key, value))
    pieces = []
    for b in plan.buckets:
        end = b.start + b.size * b.longest
        q, k, v = (
            x[b.start : end].view(b.size, b.longest, *x.shape[1:]).transpose(1, 2)
            for x in (query, key, value)
        )  # [B, n, L, d]
        out = causal_attention(q, k, v, scale).transpose(1, 2)  # [B, L, heads, d]
        pieces.append(out.reshape(-1, *out.shape[2:]))
    out = pieces[0] if len(pieces) == 1 else torch.cat(pieces)
    return out if plan.dest is None else gather_rows(out, plan.dest)


def shared_prompt_attention(query, key, value, layout: SharedPrompts, scale: float):
    """`packed_causal_attention` of micro-batch rows where samples share prompts
    (`packing.SharedPrompts`): the rows are expanded into each sample's own sequence (a shared
    prompt's rows repeated in front of each of its responses), attended causally as usual, and
    each packed row's output taken from one copy. A response row therefore attends over its
    prompt and itself exactly as in its own sequence. A prompt row's output comes from its
    first sample's copy; the other copies' outputs are dropped, so they pass gradient only
    through their keys and values, which the expansion's backward sums into the prompt's rows."""
    q, k, v = (x.index_select(0, layout.expand) for x in (query, key, value))
    out = packed_causal_attention(q, k, v, layout.cu_seqlens, scale)
    return gather_rows(out, layout.pick)

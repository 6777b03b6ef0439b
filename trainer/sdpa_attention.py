"""Core attention for megatron's SelfAttention on `F.scaled_dot_product_attention`.

megatron-core's local `DotProductAttention` rejects packed (`thd`) sequences and expects CUDA
buffers; Transformer Engine's needs CUDA. This module computes the same causal softmax
attention on any device, for both layouts megatron hands to a core attention:

* `bshd` (unpacked): query [s, b, heads, d], key/value [s, b, groups, d];
* `thd` (packed, `packed_seq_params.qkv_format == "thd"`): query [t, heads, d] with the
  sequences laid end to end, `cu_seqlens_q` marking the boundaries. Each sequence attends only
  to itself (a causal block per sequence), so packing never leaks across samples.

Grouped-query attention: query head h uses key/value group h // (heads / groups), the same
assignment as megatron's `repeat_interleave` and HF's `repeat_kv`.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule


class SDPACoreAttention(MegatronModule):
    def __init__(self, config, layer_number, attn_mask_type, attention_type,
                 attention_dropout=None, softmax_scale=None, cp_comm_type=None,
                 pg_collection=None):
        super().__init__(config=config)
        if config.context_parallel_size != 1:
            raise NotImplementedError("SDPACoreAttention does not support context parallelism")
        if attn_mask_type not in (AttnMaskType.causal, AttnMaskType.padding_causal):
            raise NotImplementedError(
                f"SDPACoreAttention supports causal masks only, got {attn_mask_type}")
        dropout = config.attention_dropout if attention_dropout is None else attention_dropout
        if dropout:
            raise NotImplementedError(
                "SDPACoreAttention has no attention dropout; set attention_dropout=0")
        self.softmax_scale = (softmax_scale if softmax_scale is not None
                              else 1.0 / math.sqrt(config.kv_channels))

    def _causal(self, q, k, v):
        # q [b, heads, s, d], k/v [b, groups, s, d]
        if q.device.type == "cpu":
            # On CPU the default (flash) kernel's blocked online softmax is measurably less exact
            # than the plain one: on a GRPO-sharpened model its log-probs were 1.1e-5 from an fp64
            # reference against 4.7e-6 with the math kernel (the engine's: 5.1e-6), which breaks
            # the engine-vs-trainer 1e-5 budget. Sequences here are short; exactness wins.
            with sdpa_kernel(SDPBackend.MATH):
                return F.scaled_dot_product_attention(
                    q, k, v, is_causal=True, scale=self.softmax_scale,
                    enable_gqa=q.size(1) != k.size(1))
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.softmax_scale,
                                              enable_gqa=q.size(1) != k.size(1))

    def forward(self, query, key, value, attention_mask, attn_mask_type=None,
                attention_bias=None, packed_seq_params=None):
        if attention_bias is not None:
            raise NotImplementedError("SDPACoreAttention does not take an attention bias")
        if packed_seq_params is not None and packed_seq_params.qkv_format == "thd":
            if attention_mask is not None:
                raise NotImplementedError("packed sequences carry their boundaries in cu_seqlens; "
                                          "pass attention_mask=None")
            bounds = packed_seq_params.cu_seqlens_q.tolist()
            outs = []
            for start, end in zip(bounds[:-1], bounds[1:]):
                # [len, heads, d] -> [1, heads, len, d]
                q, k, v = (x[start:end].transpose(0, 1).unsqueeze(0) for x in (query, key, value))
                outs.append(self._causal(q, k, v)[0].transpose(0, 1))
            out = torch.cat(outs, dim=0)  # [t, heads, d]
            return out.reshape(out.size(0), -1)  # attention.py reshapes to [t, 1, h]
        if attention_mask is not None:
            raise NotImplementedError("SDPACoreAttention applies the causal mask itself; "
                                      "pass attention_mask=None")
        # [s, b, n, d] -> [b, n, s, d]
        q, k, v = (x.permute(1, 2, 0, 3) for x in (query, key, value))
        out = self._causal(q, k, v)  # [b, heads, s, d]
        s, b = query.size(0), query.size(1)
        return out.permute(2, 0, 1, 3).reshape(s, b, -1)

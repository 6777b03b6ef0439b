"""The model's per-layer pieces (`rollout.model.LayerPieces`) on the C kernels of
`rollout.native`, for float32 and bfloat16 on the CPU: the same functions as
`DecoderLayer.attention_inputs`, `DecoderLayer.attention_outputs` and `CausalLM._logits` (their
reference), with

* RMSNorm, rotary and SiLU * up each one pass (`pointwise.c`) instead of a chain of ops;
* q and k rotated in place in the fused q/k/v projection's output;
* in float32, the residual adds folded into the o_proj and down_proj matrix multiplies
  (`addmm`, beta = 1): no separate pass over the hidden states. Not in bfloat16: addmm would add
  the residual before rounding the product to bfloat16, where the reference rounds both.

Used where `applies` says so: a CPU float32 or bfloat16 model without tensor parallelism (the
row-parallel all-reduce would come between the multiply and the add) whose kernels are available,
eagerly
(`EngineConfig.compile` keeps the torch pieces, which inductor fuses). Layers it does not cover
(q/k-norm, biases on o_proj / down_proj, unfused projections) run their reference code.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from rollout import native
from rollout.config import accum_dtype
from rollout.model import CausalLM, DecoderLayer, LayerPieces, RMSNorm
from rollout.rope import RotaryEmbedding


def applies(model: CausalLM) -> bool:
    param = model.lm_head.weight
    return (
        model.tp is None
        and param.device.type == "cpu"
        and param.dtype in native.POINTWISE_DTYPES
        and native.pointwise() is not None
    )


def use_native_pieces(model: CausalLM) -> None:
    """Switch the model's pieces to the native ones (in place)."""
    model.pieces = LayerPieces(attention_inputs, attention_outputs, logits)


def _norm(norm: RMSNorm, x: torch.Tensor) -> torch.Tensor:
    return native.rms_norm(native.pointwise(), x, norm.weight, norm.eps)


def attention_inputs(layer: DecoderLayer, x: torch.Tensor, positions, rotary: RotaryEmbedding):
    attn = layer.self_attn
    h = _norm(layer.input_layernorm, x)
    if attn.qkv_weight is None or attn.q_norm is not None:
        return attn.project(h, positions, rotary)
    heads, kv_heads = attn.num_heads, attn.num_kv_heads
    qkv = F.linear(h, attn.qkv_weight, attn.qkv_bias).view(x.shape[0], -1, attn.head_dim)
    native.rotary_(
        native.pointwise(), qkv[:, : heads + kv_heads], rotary.cos, rotary.sin, positions
    )
    q, k, v = qkv.split([heads, kv_heads, kv_heads], dim=1)
    return q, k, v


def _add_linear(x: torch.Tensor, inputs: torch.Tensor, linear: torch.nn.Linear) -> torch.Tensor:
    """x + linear(inputs), in one matrix multiply for a float32 linear without bias."""
    if (
        linear.bias is None
        and isinstance(linear, torch.nn.Linear)  # not an FP8 layer
        and x.dtype == torch.float32
    ):
        return torch.addmm(x, inputs, linear.weight.t())
    return x + linear(inputs)


def attention_outputs(layer: DecoderLayer, x: torch.Tensor, attn_out: torch.Tensor):
    attn, mlp = layer.self_attn, layer.mlp
    x = _add_linear(x, attn_out.reshape(x.shape[0], -1), attn.o_proj)
    h = _norm(layer.post_attention_layernorm, x)
    if mlp.gate_up_weight is None:
        return x + mlp(h)
    gate, up = F.linear(h, mlp.gate_up_weight, mlp.gate_up_bias).chunk(2, dim=-1)
    return _add_linear(x, native.silu_mul(native.pointwise(), gate, up), mlp.down_proj)


def logits(model: CausalLM, hidden: torch.Tensor) -> torch.Tensor:
    logits = model.lm_head(_norm(model.model.norm, hidden))
    return logits.to(accum_dtype(logits.dtype))

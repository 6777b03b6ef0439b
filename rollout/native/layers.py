"""The model's per-layer pieces (`rollout.model.LayerPieces`) on the C kernels of
`rollout.native`, for float32 and bfloat16 on the CPU: the same functions as
`DecoderLayer.attention_inputs`, `DecoderLayer.attention_outputs` and `CausalLM._logits` (their
reference), with

* RMSNorm, rotary and SiLU * up each one pass (`pointwise.c`) instead of a chain of ops;
* q and k rotated in place in the fused q/k/v projection's output;
* in float32, the residual adds folded into the o_proj and down_proj matrix multiplies
  (`addmm_`, beta = 1, into the residual itself: no separate pass over the hidden states, and
  no copy of them into a new output; `attention_outputs` may write over its x, which
  `CausalLM.forward` never reads again). Not in bfloat16: addmm would add
  the residual before rounding the product to bfloat16, where the reference rounds both; there
  the add before the post-attention norm goes into the norm's pass (`add_rms_norm_bf16`);
* the kernels called through thin wrappers (`native.*_unchecked`): the layouts these pieces make
  (new contiguous projection outputs, weights in the model dtype) checked here, not per call;
* the linear layers (q/k/v, o_proj and down_proj with their residual adds, gate_up, the LM head)
  of a batch of at most `small_linear_rows(dtype)` tokens (decode steps) on the small-batch kernel
  (`small_gemm.c`, residual added as the reference adds it), which reads the stored [out, in]
  weights once; torch's GEMM for larger batches and wherever the kernel is not built for speed;
  there, in bfloat16, the RMSNorm before q/k/v, gate_up and the LM head and the SiLU * up before
  down_proj computed in the multiply's own call (`native.small_linear_prepared_unchecked`,
  bitwise the separate calls: an FP8 model's unfused layers keep the separate calls).

Used where `applies` says so: a CPU float32 or bfloat16 model without tensor parallelism (the
row-parallel all-reduce would come between the multiply and the add) whose kernels are available,
eagerly
(`EngineConfig.compile` keeps the torch pieces, which inductor fuses). Layers it does not cover
(q/k-norm, biases on o_proj / down_proj, unfused projections) run their reference code.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from rollout import native
from rollout.config import accum_dtype
from rollout.fp8_linear import Fp8Linear
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


# At most this many rows (tokens) go to the small-batch linear kernel. Measured on the engine's
# decode shapes with the weights evicted between layers, as the K/V reads evict them in the
# engine (benchmarks/small_gemm.py; benchmarks/RESULTS.md "Small-batch linear layers"): the
# kernel's AVX-512 path is faster than torch's GEMM at 1..16 rows in both dtypes, slower from 32
# (torch's blocked float32 GEMM; its AMX path in bfloat16). bfloat16 on the kernel's own AMX
# tiles: faster than torch's up to SMALL_LINEAR_ROWS_AMX rows (RESULTS.md "bfloat16 small-batch
# linear layers on AMX tiles").
SMALL_LINEAR_ROWS = 16
SMALL_LINEAR_ROWS_AMX = 256
# float32 from 17 rows on the kernel's outer-product path (small_gemm.c, fp32_gemm), up to this
# many rows, on CPUs other than Intel's only. torch's float32 GEMM is MKL's, which dispatches its
# fastest kernels by CPU vendor: on an Intel Xeon it outran the outer products from 48 rows
# (0.88x at 256), on an AMD EPYC (Zen 4) it reached ~60 % of the FMA peak there and the outer
# products beat it at 32..256 rows (RESULTS.md "float32 decode GEMMs on AMD").
SMALL_LINEAR_ROWS_FP32_NOT_INTEL = 256
# bfloat16 from 17 rows on the kernel's vdpbf16ps outer products (small_gemm.c, bf16_outer_gemm),
# up to this many rows, where the CPU has no AMX tiles and is not Intel's: on the AMD EPYC box
# torch's bfloat16 GEMM (oneDNN's) ran 1.2-1.9x slower at 17..128 rows and level at 256
# (RESULTS.md "bfloat16 decode GEMMs on AMD").
SMALL_LINEAR_ROWS_BF16_NOT_INTEL = 128


def small_linear_rows(dtype: torch.dtype) -> int:
    """The most rows of `dtype` that `_linear` sends to the small-batch kernel (fixed for the
    process: the same rows always take the same path)."""
    limit = _ROW_LIMITS.get(dtype)
    if limit is None:
        lib = _small_gemm(dtype)
        if dtype == torch.bfloat16 and lib is not None and lib.small_gemm_has_amx():
            limit = SMALL_LINEAR_ROWS_AMX
        elif dtype == torch.bfloat16 and lib is not None and not lib.small_gemm_cpu_is_intel():
            limit = SMALL_LINEAR_ROWS_BF16_NOT_INTEL
        elif dtype == torch.float32 and lib is not None and not lib.small_gemm_cpu_is_intel():
            limit = SMALL_LINEAR_ROWS_FP32_NOT_INTEL
        else:
            limit = SMALL_LINEAR_ROWS
        _ROW_LIMITS[dtype] = limit
    return limit


_ROW_LIMITS: dict[torch.dtype, int] = {}


@functools.cache
def onednn_float32_gemm():
    """oneDNN's linear (`torch.ops.mkldnn._linear_pointwise`, the op inductor's CPU fusions
    call) for the float32 batches past the kernel's rows (prefill) on CPUs other than Intel's,
    else None (fixed for the process). Its AVX-512 kernels are chosen by the CPU's features, not
    its vendor: on the AMD EPYC box it ran the prefill's linear layers faster than MKL (engine
    prefill 1.30x, RESULTS.md "float32 decode GEMMs on AMD"); on Intel MKL keeps them."""
    lib = _small_gemm(torch.float32)
    usable = (
        lib is not None  # an x86 build with AVX-512, where the vendor check means something
        and not lib.small_gemm_cpu_is_intel()
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    )
    return torch.ops.mkldnn._linear_pointwise if usable else None


def _small_gemm(dtype: torch.dtype):
    """The small-batch linear kernel where it is built with the vector code it is fast with
    (AVX-512; AVX-512 BF16 for bfloat16), else None."""
    lib = native.small_gemm()
    return lib if lib is not None and dtype in lib.vector_dtypes else None


def _small_linear_kernel(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None):
    """The small-batch kernel for x W^T (+ bias) where x has at most `small_linear_rows` rows
    and the tensors are as it takes them, else None. The checks are the few that the model's
    tensors can fail (a decode step makes 17 of these calls)."""
    if x.dim() != 2 or x.shape[0] > small_linear_rows(x.dtype):
        return None
    lib = _small_gemm(x.dtype)
    if (
        lib is not None
        and weight.dtype == x.dtype
        and x.stride(1) == 1
        and weight.stride(1) == 1
        and (bias is None or (bias.dtype == x.dtype and bias.stride(0) == 1))
    ):
        return lib
    return None


def _linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    residual: torch.Tensor | None = None,
    overwrite_residual: bool = False,
) -> torch.Tensor:
    """F.linear(x, weight, bias) (+ residual, added to the rounded product as `residual + ...`
    adds it; in float32 through torch's GEMM as addmm adds it): on the small-batch kernel for few
    rows; past those, float32 on oneDNN where `onednn_float32_gemm` says so.
    `overwrite_residual`: nothing reads the residual afterwards, so float32's sum may go into it
    (`addmm_`: the same GEMM with beta = 1 as addmm's, without addmm's copy of the residual into
    a new output first; on oneDNN an in-place add)."""
    lib = _small_linear_kernel(x, weight, bias)
    if lib is not None and (
        residual is None or (residual.dtype == x.dtype and residual.stride(1) == 1)
    ):
        return native.small_linear_unchecked(lib, x, weight, bias, residual)
    if x.dtype == torch.float32 and (onednn := onednn_float32_gemm()) is not None:
        if x.dim() == 2 and weight.dtype == x.dtype and weight.is_contiguous():
            product = onednn(x, weight, bias, "none", [], "")
            if residual is None:
                return product
            # the rounded product, then the add: as `residual + linear(...)` rounds
            return residual.add_(product) if overwrite_residual else residual + product
    if residual is None:
        return F.linear(x, weight, bias)
    if bias is None and x.dtype == torch.float32:
        if overwrite_residual:
            return residual.addmm_(x, weight.t())
        return torch.addmm(residual, x, weight.t())
    return residual + F.linear(x, weight, bias)


def _norm(norm: RMSNorm, x: torch.Tensor) -> torch.Tensor:
    """norm(x); the per-call checks skipped where the model's tensors are as the engine makes
    them (rows of x contiguous, the weight in x's dtype): a decode step makes 2 per layer."""
    if x.stride(1) == 1 and norm.weight.dtype == x.dtype and norm.weight.stride(0) == 1:
        return native.rms_norm_unchecked(native.pointwise(), x, norm.weight, norm.eps)
    return native.rms_norm(native.pointwise(), x, norm.weight, norm.eps)


def _prepared_kernel(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None):
    """The small-batch kernel where `_linear` would send bfloat16 x's rows (or their transform)
    to it, for the element-wise step before the multiply to go into the same call
    (`native.small_linear_prepared_unchecked`); else None. Bitwise the separate calls, so an FP8
    layer (its own unfused path) still computes as the dequantized engine."""
    return _small_linear_kernel(x, weight, bias) if x.dtype == torch.bfloat16 else None


def _norm_linear(
    norm: RMSNorm, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """_linear(norm(x), weight, bias): in bfloat16 on the small-batch kernel, the norm computed
    in the same call (no normed tensor, one call fewer)."""
    lib = _prepared_kernel(x, weight, bias)
    if lib is not None and norm.weight.dtype == x.dtype and norm.weight.stride(0) == 1:
        return native.small_linear_prepared_unchecked(
            lib, native.PREPARE_RMS_NORM, x, norm.weight, norm.eps, weight, bias, None
        )
    return _linear(_norm(norm, x), weight, bias)


def _dense(linear: torch.nn.Module, dtype: torch.dtype):
    """(weight, bias) that `linear` multiplies by in `dtype`: an nn.Linear's own, an FP8 layer's
    dequantized weight (a CPU engine keeps it) and bias; None for any other layer. Both kinds
    go through `_linear`, so an FP8 engine computes exactly as the engine running its
    dequantized weights (the FP8 layers' contract), the small-batch kernel included."""
    if type(linear) is torch.nn.Linear:
        return linear.weight, linear.bias
    if type(linear) is Fp8Linear and linear.tp is None:
        return linear.dequantized_weight(dtype), linear.bias
    return None


def _fused_linear(h: torch.Tensor, linears: list[torch.nn.Module]) -> torch.Tensor | None:
    """The outputs of the unfused `linears` (an FP8 model's q/k/v or gate/up) side by side, as
    their fused projection would give them (each output one dot product on either path); None
    unless every one is `_dense`."""
    dense = [_dense(linear, h.dtype) for linear in linears]
    if any(d is None for d in dense):
        return None
    return torch.cat([_linear(h, *d) for d in dense], dim=1)


def attention_inputs(layer: DecoderLayer, x: torch.Tensor, positions, rotary: RotaryEmbedding):
    attn = layer.self_attn
    if attn.q_norm is None and attn.qkv_weight is not None:
        qkv = _norm_linear(layer.input_layernorm, x, attn.qkv_weight, attn.qkv_bias)
    else:
        h = _norm(layer.input_layernorm, x)
        if attn.q_norm is not None:
            return attn.project(h, positions, rotary)
        qkv = _fused_linear(h, [attn.q_proj, attn.k_proj, attn.v_proj])
        if qkv is None:
            return attn.project(h, positions, rotary)
    heads, kv_heads = attn.num_heads, attn.num_kv_heads
    qkv = qkv.view(x.shape[0], -1, attn.head_dim)
    # the projection's output is a new contiguous tensor: its heads are contiguous rows
    cos, sin = rotary.cos, rotary.sin
    if (
        positions.dtype == torch.int64
        and positions.is_contiguous()
        and positions.numel() == x.shape[0]
        and cos.dtype == sin.dtype == torch.float32
        and cos.is_contiguous()
        and sin.is_contiguous()
        and cos.shape == sin.shape
        and cos.shape[1] == attn.head_dim
    ):
        native.rotary_unchecked_(
            native.pointwise(), qkv[:, : heads + kv_heads], cos, sin, positions
        )
    else:
        native.rotary_(native.pointwise(), qkv[:, : heads + kv_heads], cos, sin, positions)
    q, k, v = qkv.split([heads, kv_heads, kv_heads], dim=1)
    return q, k, v


def _add_linear(x: torch.Tensor, inputs: torch.Tensor, linear: torch.nn.Linear) -> torch.Tensor:
    """x + linear(inputs), in one matrix multiply for a float32 linear without bias (and on the
    small-batch kernel for few rows). May write the sum over x: every caller's x is the
    layer's own hidden state, read by nothing after this add."""
    dense = _dense(linear, inputs.dtype)  # not a tensor-parallel layer
    if dense is not None:
        return _linear(inputs, *dense, residual=x, overwrite_residual=True)
    return x + linear(inputs)


def _silu_mul_add_linear(
    x: torch.Tensor, gate_up: torch.Tensor, linear: torch.nn.Module
) -> torch.Tensor:
    """x + linear(silu(gate) * up) of gate_up's halves (new, rows contiguous): in bfloat16 on
    the small-batch kernel, SiLU * up computed in the multiply's call."""
    dense = _dense(linear, gate_up.dtype)
    if dense is not None and x.dtype == gate_up.dtype and x.stride(1) == 1:
        weight, bias = dense
        lib = _prepared_kernel(gate_up, weight, bias)
        if lib is not None and gate_up.shape[1] == 2 * weight.shape[1]:
            return native.small_linear_prepared_unchecked(
                lib, native.PREPARE_SILU_MUL, gate_up, None, 0.0, weight, bias, x
            )
    return _add_linear(x, native.silu_mul_halves_unchecked(native.pointwise(), gate_up), linear)


def _add_linear_norm(
    x: torch.Tensor, inputs: torch.Tensor, linear: torch.nn.Linear, norm: RMSNorm
) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + linear(inputs), norm of it). In bfloat16, where `_linear` does not add the residual
    (torch's GEMM: more than `small_linear_rows` rows), the add goes into the norm's pass
    (`add_rms_norm_bf16`, the sum written over the projection's fresh output) instead of a
    torch add of its own."""
    dense = _dense(linear, inputs.dtype)
    if (
        x.dtype == torch.bfloat16
        and dense is not None
        and (x.shape[0] > small_linear_rows(x.dtype) or _small_gemm(x.dtype) is None)
        and x.stride(1) == 1
        and norm.weight.dtype == x.dtype
        and norm.weight.stride(0) == 1
    ):
        y = F.linear(inputs, *dense)  # a new tensor, rows contiguous
        h = native.add_rms_norm_unchecked_(native.pointwise(), y, x, norm.weight, norm.eps)
        return y, h
    x = _add_linear(x, inputs, linear)
    return x, _norm(norm, x)


def attention_outputs(layer: DecoderLayer, x: torch.Tensor, attn_out: torch.Tensor):
    attn, mlp = layer.self_attn, layer.mlp
    inputs = attn_out.reshape(x.shape[0], -1)
    norm = layer.post_attention_layernorm
    if mlp.gate_up_weight is not None and _prepared_kernel(x, mlp.gate_up_weight, mlp.gate_up_bias):
        # the residual added in o_proj's call (as `_add_linear_norm` adds it at these sizes),
        # the norm in gate/up's: h is only gate/up's input
        x = _add_linear(x, inputs, attn.o_proj)
        gate_up = _norm_linear(norm, x, mlp.gate_up_weight, mlp.gate_up_bias)
        return _silu_mul_add_linear(x, gate_up, mlp.down_proj)
    x, h = _add_linear_norm(x, inputs, attn.o_proj, norm)
    if mlp.gate_up_weight is not None:
        gate_up = _linear(h, mlp.gate_up_weight, mlp.gate_up_bias)  # new, rows contiguous
    elif hasattr(mlp, "gate_proj"):  # a dense MLP left unfused (FP8)
        gate_up = _fused_linear(h, [mlp.gate_proj, mlp.up_proj])
    else:  # mixture of experts
        gate_up = None
    if gate_up is None:
        return x + mlp(h)
    return _silu_mul_add_linear(x, gate_up, mlp.down_proj)


def logits(model: CausalLM, hidden: torch.Tensor) -> torch.Tensor:
    head, norm = model.lm_head, model.model.norm
    dense = _dense(head, hidden.dtype)
    logits = _norm_linear(norm, hidden, *dense) if dense is not None else head(_norm(norm, hidden))
    return logits.to(accum_dtype(logits.dtype))

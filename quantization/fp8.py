"""Block-wise FP8 weights: float8_e4m3fn values with one float32 scale per 128 x 128 block.

The convention DeepSeek-V3 checkpoints and SGLang's block-FP8 linear layers use. For a weight W
[out, in], block (i, j) covers rows [128 i, 128 i + 128) and columns [128 j, 128 j + 128), cut
short at the matrix's edge (ragged edge blocks are smaller, never padded into the values):

    scale[i, j] = amax(|W| over the block) / 448          (448: the largest e4m3fn value)
    q           = e4m3fn(clamp(W / scale[i, j], -448, 448))   round to nearest even
    W'          = q * scale[i, j]                             (dequantized, float32)

computed in float32 whatever W's dtype (bf16 and fp16 weights are exact in float32). A block
whose scale is zero (all zeros, or an amax so small that amax / 448 underflows float32) gets
scale 1: its values quantize to zero either way, and the scale stays finite. The stored scale
is the one W' multiplies by (DeepSeek names it `weight_scale_inv`: the inverse of the factor
that maps W into the e4m3 range); the tensor keeps its Hugging Face name, the scale is named
`<name>_scale_inv`.
"""

from __future__ import annotations

import re
from typing import NamedTuple

import torch

BLOCK = 128
FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448
SCALE_SUFFIX = "_scale_inv"

# The linear layers of a decoder layer (attention, the dense and expert SwiGLU MLPs, a shared
# expert). The router (`mlp.gate`), `shared_expert_gate`, embeddings, norms and the LM head stay
# in the model dtype: small, and the router's choices are discrete.
_LINEAR = re.compile(r"\.(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)\.weight$")


class QuantizedWeight(NamedTuple):
    weight: torch.Tensor  # float8_e4m3fn, the input's shape
    scale_inv: torch.Tensor  # float32 [ceil(out / 128), ceil(in / 128)]


def is_quantized_weight(name: str) -> bool:
    """Whether the Hugging Face parameter `name` is held in FP8 when quantization is on."""
    return _LINEAR.search(name) is not None


def scale_name(weight_name: str) -> str:
    return weight_name + SCALE_SUFFIX


def scale_shape(shape: tuple[int, ...] | torch.Size) -> tuple[int, int]:
    out_features, in_features = shape
    return -(-out_features // BLOCK), -(-in_features // BLOCK)


def _blocks(x: torch.Tensor) -> torch.Tensor:
    """x [out, in] zero-padded to whole blocks, viewed [out blocks, 128, in blocks, 128]. The
    padding is zeros: it leaves every block's amax as it is, and is cut off again."""
    rows, cols = scale_shape(x.shape)
    padded = torch.nn.functional.pad(
        x, (0, cols * BLOCK - x.shape[1], 0, rows * BLOCK - x.shape[0])
    )
    return padded.view(rows, BLOCK, cols, BLOCK)


def _expand(scale: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """scale [rows, cols] repeated over its blocks, cut to `shape`."""
    whole = scale.repeat_interleave(BLOCK, dim=0).repeat_interleave(BLOCK, dim=1)
    return whole[: shape[0], : shape[1]]


@torch.no_grad()
def quantize(weight: torch.Tensor) -> QuantizedWeight:
    """The block-wise FP8 form of a 2-D floating-point weight (on its device)."""
    if weight.dim() != 2:
        raise ValueError(
            f"FP8 block quantization takes 2-D weights, got shape {tuple(weight.shape)}"
        )
    if weight.dtype == torch.float64:
        raise ValueError(
            "FP8 block quantization takes float32 / bfloat16 / float16 weights, not float64"
        )
    w = weight.float()
    amax = _blocks(w).abs().amax(dim=(1, 3))
    scale = amax / FP8_MAX
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = (w / _expand(scale, w.shape)).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return QuantizedWeight(q, scale)


def dequantize(
    weight: torch.Tensor, scale_inv: torch.Tensor, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """q * scale in float32 (exactly the function the engine's FP8 linear layers compute with),
    then cast to `dtype`."""
    out_features, in_features = weight.shape
    if out_features % BLOCK == 0 and in_features % BLOCK == 0:  # whole blocks: broadcast
        rows, cols = scale_inv.shape
        blocks = weight.float().view(rows, BLOCK, cols, BLOCK) * scale_inv[:, None, :, None]
        w = blocks.view(out_features, in_features)
    else:
        w = weight.float() * _expand(scale_inv, weight.shape)
    return w if dtype == torch.float32 else w.to(dtype)

"""FP8 (e4m3) storage of the KV pool: per-(layer, KV head) scales, quantize and dequantize.

A stored value is `x8 = saturate(x / scale)` in float8_e4m3fn, read back as `x8 * scale`.

Scales are powers of two. Multiplying an e4m3 value (3 mantissa bits) by a power of two is exact
in bfloat16, float16 (in range), float32 and float64, so the dequantized K/V are the same numbers
whichever path reads them (torch gathers, suffix lanes, the C kernel's float32 input, the Triton
kernels) and whatever dtype it computes in; re-storing a dequantized value gives back the same
byte. A power of two also loses nothing of e4m3's relative precision, which is the same at every
binade: the scale only decides where the representable range starts and ends.

Where the scales come from is `rollout.kv_calibration` (a deterministic function of the weights).
"""

from __future__ import annotations

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8_DTYPE).max  # 448
# Headroom of the calibrated range over the largest |K| / |V| the calibration saw: 2x, and the
# rounding of the scale up to a power of two adds up to 2x more. Values beyond it saturate.
CALIBRATION_MARGIN = 2.0
# A head whose calibration K or V is all zeros still gets a finite scale (any scale stores its
# zeros exactly).
_MIN_AMAX = 2.0**-60

KV_CACHE_DTYPES = {"fp8_e4m3": FP8_DTYPE}


def scales_from_amax(amax: torch.Tensor, margin: float = CALIBRATION_MARGIN) -> torch.Tensor:
    """The smallest power of two s with margin * amax / s <= FP8_MAX, per element (float32)."""
    need = amax.to(torch.float32).clamp_min(_MIN_AMAX) * (margin / FP8_MAX)
    mantissa, exponent = torch.frexp(need)  # need = mantissa * 2^exponent, mantissa in [0.5, 1)
    exponent = exponent - (mantissa == 0.5).to(exponent.dtype)  # an exact power of two stays
    return torch.ldexp(torch.ones_like(need), exponent)


def head_scale(scale: torch.Tensor, head_axis: int, ndim: int) -> torch.Tensor:
    """Per-head scales [Hkv] shaped to broadcast over a tensor of `ndim` dimensions whose
    KV-head axis is `head_axis` (0 for the pool's head-major layout, -2 for new [T, Hkv, D])."""
    shape = [1] * ndim
    shape[head_axis] = -1
    return scale.view(shape)


def quantize(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x -> float8_e4m3fn, `scale` broadcast over x (`head_scale`); values beyond
    +-FP8_MAX * scale saturate. Divides in float32 (at least): a power of two divides exactly."""
    wide = x.to(torch.promote_types(x.dtype, torch.float32))
    return (wide / scale.to(wide.dtype)).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def dequantize(x8: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x8 * scale (`scale` broadcast over x8) in `dtype`; exact."""
    wide = torch.promote_types(dtype, torch.float32)  # float16 cannot hold every scale
    return (x8.to(wide) * scale.to(wide)).to(dtype)


def count_clipped(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """How many elements of x `quantize` saturates (a device tensor: no host sync)."""
    return (x.to(torch.float32).abs() > FP8_MAX * scale.to(torch.float32)).sum()

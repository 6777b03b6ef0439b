"""KV store: write the batch's new K/V rows into one layer of the paged pool.

Computes the same function as the reference
`k_cache.index_copy_(1, out_slots, k.transpose(0, 1))` (and the same for V) in one launch for
both tensors. One program per new token copies that token's [Hkv, D] tile of K and of V to
its slot; the pool is head-major ([Hkv, slots, D]) so the tile lands as Hkv rows of D
contiguous elements, `stride(0)` apart.

With `k_scale` / `v_scale` ([Hkv] float32) the pool is FP8 (float8_e4m3fn): each value is
stored as saturate(x / scale), rounded to nearest even, the function of `rollout.kv_quant.quantize`
(the scales are powers of two, so x * (1 / scale) is that quotient exactly).

Invariant the caller keeps (as for index_copy_): slots are distinct. Two tokens writing one
slot would race, and which one wins is unspecified (index_copy_ does not promise it either).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _round_to_e4m3(y):
    """float32 y in [-448, 448] -> the nearest float8_e4m3fn value (ties to even), still float32,
    so the conversion that follows is exact. Written out rather than left to the conversion: the
    Triton interpreter's float32 -> e4m3 rounding drops the carry into the exponent (125 -> 64),
    and written out the kernel rounds alike on every device (torch's cast does the same)."""
    bits = y.to(tl.int32, bitcast=True)
    # normal range: keep 3 of float32's 23 mantissa bits, round half to even (a carry moves into
    # the exponent by itself); -1048576 = ~0xFFFFF
    normal = ((bits + 0x7FFFF + ((bits >> 20) & 1)) & -1048576).to(tl.float32, bitcast=True)
    # subnormal range (|y| < 2^-6): multiples of 2^-9, by float32's own round-half-even on
    # adding 1.5 * 2^14; a zero keeps y's sign
    subnormal = (y + 24576.0) - 24576.0
    subnormal = tl.where(subnormal == 0.0, y * 0.0, subnormal)
    return tl.where(tl.abs(y) < 0.015625, subnormal, normal)


@triton.jit
def _kv_store_kernel(
    k_ptr,
    v_ptr,  # new rows: [T, Hkv, D]
    k_cache_ptr,
    v_cache_ptr,  # one layer of the pool: [Hkv, slots, D]
    k_inv_scale_ptr,
    v_inv_scale_ptr,  # [Hkv] float32 1 / scale, exact for a power of two (if QUANTIZE)
    slots_ptr,  # [T]
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_kch,
    stride_kcs,
    stride_vch,
    stride_vcs,
    num_kv_heads,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    QUANTIZE: tl.constexpr,
    FP8_MAX: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    # int64 slot: slot * stride overflows int32 in pools past 2^31 elements per layer.
    slot = tl.load(slots_ptr + token).to(tl.int64)
    heads = tl.arange(0, BLOCK_H).to(tl.int64)
    dims = tl.arange(0, BLOCK_D)
    # Blocks are powers of two (tl.arange needs them); the mask trims them to Hkv x D.
    mask = (heads[:, None] < num_kv_heads) & (dims[None, :] < HEAD_DIM)
    k = tl.load(k_ptr + token * stride_kt + heads[:, None] * stride_kh + dims[None, :], mask=mask)
    v = tl.load(v_ptr + token * stride_vt + heads[:, None] * stride_vh + dims[None, :], mask=mask)
    if QUANTIZE:
        head_ok = heads < num_kv_heads
        # x * (1 / scale), exact: no reliance on the device's division rounding
        k_inv = tl.load(k_inv_scale_ptr + heads, mask=head_ok, other=1.0)
        v_inv = tl.load(v_inv_scale_ptr + heads, mask=head_ok, other=1.0)
        k = tl.clamp(k.to(tl.float32) * k_inv[:, None], -FP8_MAX, FP8_MAX)
        v = tl.clamp(v.to(tl.float32) * v_inv[:, None], -FP8_MAX, FP8_MAX)
        k = _round_to_e4m3(k).to(k_cache_ptr.dtype.element_ty)
        v = _round_to_e4m3(v).to(v_cache_ptr.dtype.element_ty)
    tl.store(
        k_cache_ptr + heads[:, None] * stride_kch + slot * stride_kcs + dims[None, :], k, mask=mask
    )
    tl.store(
        v_cache_ptr + heads[:, None] * stride_vch + slot * stride_vcs + dims[None, :], v, mask=mask
    )


def triton_store_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    out_slots: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """k, v: [T, Hkv, D]; k_cache, v_cache: [Hkv, slots, D] (one layer); out_slots: [T] int;
    k_scale, v_scale: [Hkv] float32 for a float8_e4m3fn pool."""
    if k.shape != v.shape or k.dim() != 3:
        raise ValueError(
            f"triton_store_kv: k {tuple(k.shape)} and v {tuple(v.shape)} must both be [T, Hkv, D]"
        )
    num_tokens, num_kv_heads, head_dim = k.shape
    if (
        k_cache.shape != v_cache.shape
        or k_cache.dim() != 3
        or k_cache.shape[0] != num_kv_heads
        or k_cache.shape[2] != head_dim
    ):
        raise ValueError(
            f"triton_store_kv: caches {tuple(k_cache.shape)} must be [Hkv={num_kv_heads}, slots, "
            f"D={head_dim}] like k"
        )
    quantize = k_scale is not None
    stored = torch.float8_e4m3fn if quantize else k.dtype
    if not (k.dtype == v.dtype and k_cache.dtype == v_cache.dtype == stored):
        raise ValueError(
            f"triton_store_kv: the pool dtype {k_cache.dtype} must be k/v's {k.dtype}, or "
            "float8_e4m3fn with scales"
        )
    if quantize and any(
        s is None or s.shape != (num_kv_heads,) or s.dtype != torch.float32
        for s in (k_scale, v_scale)
    ):
        raise ValueError(f"triton_store_kv: k_scale, v_scale must be float32 [Hkv={num_kv_heads}]")
    if out_slots.shape != (num_tokens,):
        raise ValueError(
            f"triton_store_kv: out_slots {tuple(out_slots.shape)} must be [T={num_tokens}]"
        )
    if num_tokens == 0:
        return
    # The kernel addresses the last dimension with unit stride.
    k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (k, v))
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("triton_store_kv: the pool's head_dim must be contiguous")
    _kv_store_kernel[(num_tokens,)](
        k,
        v,
        k_cache,
        v_cache,
        1.0 / k_scale if quantize else out_slots,  # never read without QUANTIZE
        1.0 / v_scale if quantize else out_slots,
        out_slots,
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        v_cache.stride(0),
        v_cache.stride(1),
        num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_H=triton.next_power_of_2(num_kv_heads),
        BLOCK_D=triton.next_power_of_2(head_dim),
        QUANTIZE=quantize,
        FP8_MAX=torch.finfo(torch.float8_e4m3fn).max,
    )

"""KV store: write the batch's new K/V rows into one layer of the paged pool.

Computes the same function as the reference
`k_cache.index_copy_(1, out_slots, k.transpose(0, 1))` (and the same for V) in one launch for
both tensors. One program per new token copies that token's [Hkv, D] tile of K and of V to
its slot; the pool is head-major ([Hkv, slots, D]) so the tile lands as Hkv rows of D
contiguous elements, `stride(0)` apart.

Invariant the caller keeps (as for index_copy_): slots are distinct. Two tokens writing one
slot would race, and which one wins is unspecified (index_copy_ does not promise it either).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _kv_store_kernel(
    k_ptr,
    v_ptr,  # new rows: [T, Hkv, D]
    k_cache_ptr,
    v_cache_ptr,  # one layer of the pool: [Hkv, slots, D]
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
) -> None:
    """k, v: [T, Hkv, D]; k_cache, v_cache: [Hkv, slots, D] (one layer); out_slots: [T] int."""
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
    if not (k.dtype == v.dtype == k_cache.dtype == v_cache.dtype):
        raise ValueError(
            f"triton_store_kv: k/v dtype {k.dtype} must equal the pool dtype {k_cache.dtype}"
        )
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
    )

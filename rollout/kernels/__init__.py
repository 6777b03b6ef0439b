"""Triton kernels of the engine's GPU path; each computes the same function as a torch
reference in `rollout.attention` and is tested against it (on CPU with TRITON_INTERPRET=1).

Importing this package imports triton; the engine imports it only for attention_backend="triton".
"""

from rollout.kernels.decode_attention import (
    cascade_plan,
    split_k_decode_attention,
    triton_cascade_decode_attention,
    triton_paged_decode_attention,
)
from rollout.kernels.kv_store import triton_store_kv
from rollout.kernels.triton_attention import TritonAttention

__all__ = [
    "TritonAttention",
    "cascade_plan",
    "split_k_decode_attention",
    "triton_cascade_decode_attention",
    "triton_paged_decode_attention",
    "triton_store_kv",
]

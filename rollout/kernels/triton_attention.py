"""`TritonAttention`: the attention backend of `rollout.attention`, with Triton kernels on the
hot paths.

Same interface and same function as `TorchAttention`: new K/V are stored by the KV-store kernel
(quantized there for an FP8 pool),
decode tokens attend through the split-K cascade kernel, prefill chunks through SDPA (as in the
reference; prefill is compute-bound and SDPA's flash kernels serve it well). Runs on CUDA, or on
CPU when TRITON_INTERPRET=1 was set before `rollout.kernels` was imported (tests).
"""

from __future__ import annotations

import torch

from rollout.attention import AttentionMetadata, DecodeMetadata, prefill_attention
from rollout.kernels.decode_attention import (
    DecodeQueries,
    Phase,
    cascade_plan,
    split_k_decode_attention,
)
from rollout.kernels.kv_store import triton_store_kv
from rollout.kv_pool import KVPool


class TritonAttention:
    def __init__(
        self, pool: KVPool, *, block_n: int | None = None, chunk_tokens: int | None = None
    ):
        self.pool = pool
        self.block_n = block_n
        self.chunk_tokens = chunk_tokens
        # The decode plan depends on the step's metadata only, which every layer shares: build it
        # at the first layer and reuse it. The metadata object is held and compared by identity,
        # so a later step's metadata can never be mistaken for it.
        self._plan_for: DecodeMetadata | None = None
        self._plan: tuple[list[Phase], DecodeQueries] | None = None

    def forget_plan(self) -> None:
        """Drop the cached decode plan: it holds tensors of the last step's metadata (a graph's
        static buffers, tensors made during its capture), which must not outlive a release."""
        self._plan_for = self._plan = None

    def forward(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        """q: [T, H, D]; k, v: [T, Hkv, D] for the batch's new tokens -> [T, H, D]."""
        k_cache, v_cache = self.pool.k[layer], self.pool.v[layer]  # [Hkv, slots, D]
        scales = self.pool.scales(layer)
        triton_store_kv(k, v, k_cache, v_cache, meta.out_slots, *(scales or ()))
        if scales is not None and meta.prefill:  # prefill attends the new K/V as stored
            k, v = self.pool.held(layer, k, v)
        elif scales is not None:  # decode reads them from the cache: only counted
            self.pool.count_stored(layer, k, v)
        out = torch.empty_like(q)
        if meta.decode is not None:
            if self._plan_for is not meta.decode:
                self._plan, self._plan_for = cascade_plan(meta.decode), meta.decode
            phases, queries = self._plan
            out[: meta.num_decode] = split_k_decode_attention(
                q[: meta.num_decode],
                k_cache,
                v_cache,
                self.pool.page_size,
                phases,
                queries,
                block_n=self.block_n,
                chunk_tokens=self.chunk_tokens,
                kv_scales=scales,
            )
        prefill_attention(q, k, v, k_cache, v_cache, meta.prefill, out, kv_scales=scales)
        return out

"""The paged KV pool: one K and one V tensor for all layers, carved into pages of `page_size` slots.

A *slot* holds the K/V of one token in every layer; slot `s` lies in page `s // page_size`.
Pages are the unit of allocation and sharing; slots are what attention indexes. Layout is
[layer, kv_head, slot, head_dim] (head-major), so a gather of slots yields K/V already shaped
for batched matmuls per KV head.

A mixture of experts' pool also holds each slot's routed experts (`routes`, [slot, sparse layer,
k], see `rollout.routes`), allocated, freed and copied with the K/V.

With a `storage_dtype` below the model dtype (float8_e4m3fn, `rollout.kv_quant`) the pool is
*quantized*: K and V are stored as FP8 with per-(layer, KV head) power-of-two scales. Attention
then works on the dequantized values everywhere, the new tokens' included (`store` returns them),
so a token's K/V are the same numbers whether read from the batch, a suffix lane or the pool.
The scales are NaN until the engine calibrates them (`set_scales`): attention over an
uncalibrated pool is NaN, never silently scaled by 1.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

from rollout import native
from rollout.kv_quant import count_clipped, dequantize, head_scale, quantize
from rollout.routes import RouteLayout


def store_rows(dst: torch.Tensor, index: torch.Tensor, src: torch.Tensor) -> None:
    """dst [Hkv, N, D][:, index[t]] = src [T, Hkv, D][t]: the K/V stores of the pool and the
    suffix lanes. float32 or bfloat16 on CPU through the C row scatter (its rows copied by all
    threads); otherwise `index_copy_`, its reference."""
    if (
        src.dtype == dst.dtype
        and src.dtype in native.POINTWISE_DTYPES
        and src.device.type == "cpu"
        and src.stride(-1) == 1
        and src.stride(-2) == src.shape[-1]
        and (lib := native.pointwise()) is not None
    ):
        native.scatter_rows_(lib, dst, index, src)
    else:
        dst.index_copy_(1, index, src.transpose(0, 1).to(dst.dtype))


def store_kv_rows(
    dst_k: torch.Tensor, dst_v: torch.Tensor, index: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> None:
    """`store_rows(dst_k, index, k)` and `store_rows(dst_v, index, v)`: in one C call where both
    pairs share a layout (a layer's K and V; k, v views of one projection's output)."""
    if (
        k.dtype == v.dtype == dst_k.dtype == dst_v.dtype
        and k.dtype in native.POINTWISE_DTYPES
        and k.device.type == "cpu"
        and k.stride() == v.stride()
        and k.shape == v.shape
        and k.stride(-1) == 1
        and k.stride(-2) == k.shape[-1]
        and dst_k.stride() == dst_v.stride()
        and dst_k.shape == dst_v.shape
        and (lib := native.pointwise()) is not None
    ):
        native.scatter_kv_rows_(lib, dst_k, dst_v, index, k, v)
    else:
        store_rows(dst_k, index, k)
        store_rows(dst_v, index, v)


def index_select(x: torch.Tensor, dim: int, index: torch.Tensor) -> torch.Tensor:
    """`x.index_select(dim, index)` for any dtype: float8 through its bytes (index_select has no
    float8 kernel on every device)."""
    if x.dtype == torch.float8_e4m3fn:
        return x.view(torch.uint8).index_select(dim, index).view(x.dtype)
    return x.index_select(dim, index)


class SlotWrite(NamedTuple):
    """K/V written into slots from outside a forward (a prefill handoff admitted), every KV head
    of the model: [L, Hkv, len(slots), D]."""

    slots: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor


class KVPool:
    def __init__(
        self,
        *,
        num_layers: int,
        num_pages: int,
        page_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
        scratch_page: bool = False,
        route_layout: RouteLayout | None = None,
        storage_dtype: torch.dtype | None = None,
    ):
        self.num_layers = num_layers
        self.num_pages = num_pages
        # One more page past the allocatable ones, never handed out: static-shape decode steps
        # (rollout.decode_graphs) point their padding rows at it.
        self.scratch_page = num_pages if scratch_page else None
        self.page_size = page_size
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype  # of the K/V attention computes with (the model's)
        self.storage_dtype = storage_dtype or dtype  # of the K/V stored
        self.quantized = self.storage_dtype != dtype
        self.device = device
        # Quantized: per-(layer, KV head) scales [L, Hkv], kept across release/resume (they are
        # a function of the weights), and the count of stored values that saturated.
        self.k_scale = self.v_scale = None
        if self.quantized:
            nan = torch.full((num_layers, num_kv_heads), float("nan"), device=device)
            self.k_scale, self.v_scale = nan, nan.clone()
            self.clipped = torch.zeros((), dtype=torch.int64, device=device)
            self.stored = torch.zeros((), dtype=torch.int64, device=device)
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None
        self.route_layout = route_layout  # None: no routes kept (a dense model, a TP follower)
        self.routes: torch.Tensor | None = None
        self._free_pages: list[int] = []
        # Under tensor parallelism this pool holds the model's KV heads
        # [head_offset, head_offset + num_kv_heads) (`write_slots` takes its share of all of them).
        self.head_offset = 0
        # Set by a tensor-parallel rank 0: the page copies (`(src page, dst page, tokens)`) and
        # slot writes (`SlotWrite`) its scheduler made since the last step, in order, which the
        # other ranks replay on their pools (`replay`) before that step's forward.
        self.copy_log: list[tuple[int, int, int] | SlotWrite] | None = None
        self.allocate()

    @staticmethod
    def bytes_per_token(
        num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
    ) -> int:
        """K and V of one token in every layer, stored as `dtype` (the pool's storage dtype)."""
        return (
            2 * num_layers * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()
        )

    @property
    def num_slots(self) -> int:
        return self.num_pages * self.page_size

    @property
    def allocated(self) -> bool:
        return self.k is not None

    def allocate(self, num_pages: int | None = None) -> None:
        """Create the K/V tensors, every page free; `num_pages` re-sizes the pool (it must be
        released: nothing holds a page)."""
        if num_pages is not None:
            assert self.k is None, "re-sizing a KV pool that is allocated"
            self.num_pages = num_pages
            if self.scratch_page is not None:
                self.scratch_page = num_pages
        pages = self.num_pages + (self.scratch_page is not None)
        shape = (self.num_layers, self.num_kv_heads, pages * self.page_size, self.head_dim)
        self.k = torch.zeros(shape, dtype=self.storage_dtype, device=self.device)
        self.v = torch.zeros(shape, dtype=self.storage_dtype, device=self.device)
        if self.route_layout is not None:
            layers, top_k, route_dtype = self.route_layout
            self.routes = torch.zeros(
                (pages * self.page_size, layers, top_k), dtype=route_dtype, device=self.device
            )
        # Zeros, not empty: padded attention reads slot 0 with weight 0, and 0 * NaN would be NaN.
        # Popped from the end: low page ids are handed out first, which keeps small runs compact.
        self._free_pages = list(range(self.num_pages - 1, -1, -1))

    def free_memory(self) -> None:
        """Drop the K/V tensors (the caller has already released every page)."""
        self.k = self.v = self.routes = None
        self._free_pages = []
        if self.copy_log is not None:
            self.copy_log.clear()

    # -- K/V in and out ----------------------------------------------------------------------
    def store(
        self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write the new tokens' k, v [T, Hkv, D] to `slots` of `layer`; returns the K/V as the
        pool holds them, which attention must use for these tokens too (quantized: dequantized
        from what was stored; otherwise k, v themselves)."""
        if not self.quantized:
            store_kv_rows(self.k[layer], self.v[layer], slots, k, v)
            return k, v
        held = []
        for cache, scales, x in ((self.k, self.k_scale, k), (self.v, self.v_scale, v)):
            x8 = quantize(x, head_scale(scales[layer], -2, 3))
            # index_copy_ has no float8 kernel on every device: copy the bytes
            cache[layer].view(torch.uint8).index_copy_(
                1, slots, x8.transpose(0, 1).view(torch.uint8)
            )
            held.append(self._held(layer, x, x8, scales))
        return held[0], held[1]

    def held(
        self, layer: int, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """New k, v [T, Hkv, D] as a quantized pool holds them once stored (a backend that
        stores through its own kernel attends these), counted as stored."""
        return tuple(
            self._held(layer, x, quantize(x, head_scale(s[layer], -2, 3)), s)
            for x, s in ((k, self.k_scale), (v, self.v_scale))
        )

    def count_stored(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Count new k, v [T, Hkv, D] that a backend's own kernel stored in a quantized pool,
        when nothing attends them as held (a decode-only step reads them from the cache)."""
        for x, s in ((k, self.k_scale), (v, self.v_scale)):
            self.clipped += count_clipped(x, head_scale(s[layer], -2, 3))
            self.stored += x.numel()

    def _held(self, layer, x: torch.Tensor, x8: torch.Tensor, scales) -> torch.Tensor:
        scale = head_scale(scales[layer], -2, 3)
        self.clipped += count_clipped(x, scale)
        self.stored += x.numel()
        return dequantize(x8, scale, x.dtype)

    def dequantized(
        self, stored: torch.Tensor, which: str, layer: int | None = None
    ) -> torch.Tensor:
        """K (`which` "k") or V ("v") read from the pool -> `accum_dtype` values: `stored` is
        [L, Hkv, ...] (every layer) or, with `layer`, [Hkv, ...]. Dequantized if quantized."""
        wide = torch.promote_types(self.dtype, torch.float32)
        if not self.quantized:
            return stored.to(wide)
        scales = self.k_scale if which == "k" else self.v_scale
        if layer is not None:
            return dequantize(stored, head_scale(scales[layer], 0, stored.dim()), wide)
        return dequantize(stored, scales.view(scales.shape + (1,) * (stored.dim() - 2)), wide)

    def read_slots(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K, V of `slots` in every layer, [L, Hkv, len(slots), D] in the model dtype
        (dequantized from an FP8 pool): what leaves the engine (a prefill handoff)."""
        k, v = (index_select(x, 2, slots) for x in (self.k, self.v))
        if not self.quantized:
            return k, v
        return self.dequantized(k, "k").to(self.dtype), self.dequantized(v, "v").to(self.dtype)

    def write_slots(self, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """`read_slots`' inverse: k, v [L, Hkv, len(slots), D] (any float dtype) into `slots` of
        every layer, quantized with this pool's scales if it is FP8. Under tensor parallelism
        k, v may hold every KV head of the model: this rank keeps its own (`head_offset`), and a
        rank 0 logs the write for the other ranks to keep theirs."""
        if self.copy_log is not None:
            self.copy_log.append(SlotWrite(slots.clone(), k, v))  # the row may change
        if k.shape[1] != self.num_kv_heads:
            k = k.narrow(1, self.head_offset, self.num_kv_heads)
            v = v.narrow(1, self.head_offset, self.num_kv_heads)
        if not self.quantized:
            self.k.index_copy_(2, slots, k.to(self.device, self.dtype))
            self.v.index_copy_(2, slots, v.to(self.device, self.dtype))
            return
        for cache, scales, x in ((self.k, self.k_scale, k), (self.v, self.v_scale, v)):
            x8 = quantize(x.to(self.device), scales.view(scales.shape + (1, 1)))
            cache.view(torch.uint8).index_copy_(2, slots, x8.view(torch.uint8))

    def scales(self, layer: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Quantized: the K and V scales [Hkv] of `layer`; else None."""
        return (self.k_scale[layer], self.v_scale[layer]) if self.quantized else None

    def set_scales(self, k_scale: torch.Tensor, v_scale: torch.Tensor) -> None:
        """New scales [L, Hkv] (in place: static decode graphs hold the tensors). K/V already
        stored (running or parked sequences kept across a weight update) are re-quantized to
        them: the scales are powers of two, so this is exact except where a value now saturates
        or leaves e4m3's normal range (fewer mantissa bits below it). Only the (layer, head)
        pairs whose scale changed are rewritten, one at a time (bounded float32 scratch)."""
        assert self.quantized and k_scale.shape == self.k_scale.shape
        old = (self.k_scale.clone(), self.v_scale.clone())
        self.k_scale.copy_(k_scale)
        self.v_scale.copy_(v_scale)
        if self.k is None or not bool(torch.isfinite(old[0]).all()):
            return
        for cache, before, after in (
            (self.k, old[0], self.k_scale),
            (self.v, old[1], self.v_scale),
        ):
            for layer, head in (before != after).nonzero().tolist():
                x = dequantize(cache[layer, head], before[layer, head], torch.float32)
                cache[layer, head].copy_(quantize(x, after[layer, head]))

    def clipped_share(self) -> float:
        """Quantized: the share of the values stored so far that saturated (0.0 otherwise)."""
        if not self.quantized:
            return 0.0
        return float(self.clipped) / max(1, int(self.stored))

    # -- pages -------------------------------------------------------------------------------
    @property
    def num_free_pages(self) -> int:
        return len(self._free_pages)

    def free_page_ids(self) -> list[int]:
        return list(self._free_pages)

    def alloc_pages(self, count: int) -> list[int] | None:
        """`count` free pages, or None (and nothing taken) if there are not that many."""
        if count > len(self._free_pages):
            return None
        if count == 0:
            return []
        taken = self._free_pages[-count:]
        del self._free_pages[-count:]
        return taken[::-1]

    def free_pages(self, pages: list[int]) -> None:
        self._free_pages.extend(pages)

    def replay(self, ops) -> None:
        """A tensor-parallel rank 0's `copy_log` entries, in order, on another rank's pool."""
        for op in ops:
            if isinstance(op, SlotWrite):
                self.write_slots(op.slots, op.k, op.v)
            else:
                self.copy_page_prefix(*op)

    def copy_page_prefix(self, src_page: int, dst_page: int, num_tokens: int) -> None:
        """Copy the first `num_tokens` slots of a page (all layers): used when samples fork
        from a prompt whose last page is only partly filled."""
        if self.copy_log is not None:
            self.copy_log.append((src_page, dst_page, num_tokens))
        src = src_page * self.page_size
        dst = dst_page * self.page_size
        self.k[:, :, dst : dst + num_tokens] = self.k[:, :, src : src + num_tokens]
        self.v[:, :, dst : dst + num_tokens] = self.v[:, :, src : src + num_tokens]
        if self.routes is not None:
            self.routes[dst : dst + num_tokens] = self.routes[src : src + num_tokens]


def write_page_slots(
    slot_table: torch.Tensor, row: int, pages: list[int], first_page: int, page_size: int
) -> None:
    """slot_table[row, positions of pages[first_page:]] <- their slots (page p holds slots
    p * page_size ... p * page_size + page_size - 1). Positions past the table's width, the
    longest sequence, are never written."""
    start, end = first_page * page_size, min(len(pages) * page_size, slot_table.shape[1])
    if start >= end:
        return
    if slot_table.device.type == "cpu":  # numpy on the same memory: a fraction of torch's calls
        new = np.asarray(pages[first_page:], dtype=np.int64)[:, None] * page_size
        slot_table.numpy()[row, start:end] = (new + np.arange(page_size)).ravel()[: end - start]
        return
    new_pages = torch.tensor(pages[first_page:], dtype=torch.int64)
    slots = (new_pages[:, None] * page_size + torch.arange(page_size)).flatten()[: end - start]
    slot_table[row, start:end] = slots.to(slot_table.device)

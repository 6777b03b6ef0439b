"""Paged attention over the KV pool.

One engine step runs a *mixed* batch: first the decode tokens (one per running sequence), then
the prefill chunks. `AttentionMetadata` says where each new token's K/V goes and which slots each
query reads; it is built once per step and shared by all layers.

Decode attention is *shared-prefix (cascade) attention*. Sequences that fork from one prompt lock
the same radix node, and their contexts start with the same cached pages. Decode queries are
grouped by that node: each group's prefix K/V is read once and multiplied with the queries of all
its members, and only each sequence's private suffix is read per sequence. The two parts are
combined in one exact softmax over prefix + suffix. For GRPO (n samples per prompt) this divides
the prompt's share of the attention memory traffic by n, on any device. A sequence with no shared
prefix is a group of its own whose prefix is empty.

The pool is head-major ([Hkv, slots, D] per layer) so gathered K/V are already laid out as
[Hkv, batch, length, D] for batched matmuls: no transposed copies on the hot path.

`TorchAttention` is the reference implementation on any device (plain torch); a Triton backend
computing the same function plugs in behind the same `forward`. With `SuffixLanes`
(`rollout/suffix_lanes.py`) the torch backend reads decode suffixes from persistent per-sequence
buffers instead of gathering them from the pool every step; the function computed is the same.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from rollout import native
from rollout.config import accum_dtype
from rollout.kv_pool import KVPool, index_select
from rollout.kv_quant import dequantize, head_scale
from rollout.suffix_lanes import SuffixLanes


@dataclass(frozen=True)
class PrefillSegment:
    token_start: int  # first row of this chunk in the flat batch
    num_new: int  # tokens computed in this chunk
    context_slots: torch.Tensor  # [C] slots of the whole visible context (cached prefix + chunk)
    # Tokens of the context before the chunk (a cached prefix): query i sees context positions
    # <= prefix_len + i (causal, aligned to the context's end). 0 when the context is the chunk
    # itself: plain causal attention over the chunk's own new K/V.
    prefix_len: int = 0


@dataclass(frozen=True)
class DecodeMetadata:
    """Decode sequences grouped by shared prefix; G groups of at most M members, D sequences,
    each with 1 to Q query tokens (its pending token, plus drafted tokens when speculating).

    Contexts are read a page at a time (a page is `page_size` consecutive slots): group prefixes
    are whole pages, and each suffix starts on a page boundary. Query tokens sit in a padded
    [D, Q] grid; a padding cell repeats a real query of its sequence and is never read back."""

    prefix_pages: torch.Tensor  # [G, Np] pages of each group's shared prefix (padded with page 0)
    prefix_bias: torch.Tensor  # [G, Np * page_size] float, 0 = real token, -inf = padding
    member_index: torch.Tensor  # [D] position of each sequence in the flattened [G, M] grid
    group_size: int  # M
    # [D, Ns] each sequence's own pages after its group prefix; None when the suffixes are read
    # from the lanes (`lane_write` is set)
    suffix_pages: torch.Tensor | None
    suffix_bias: torch.Tensor  # [D, Q, Ns * page_size] float: 0 = visible to that query (causal)
    query_index: torch.Tensor  # [D * Q] batch row of the query in each grid cell
    token_cell: torch.Tensor  # [num_tokens] grid cell of each decode token, in batch order
    # Set when the grid order is the lane order of `SuffixLanes`: where each decode token's K/V
    # is mirrored (flat lane * capacity + offset, batch order); the suffix is then read from the
    # lanes (`suffix_pages` is None).
    lane_write: torch.Tensor | None = None
    # With lanes: what identifies the groups' prefixes across steps (`SuffixLanes.prefix`): each
    # group leader's (kv_epoch, num_tree_pages), in group order.
    prefix_key: tuple | None = None
    # member_index is arange(D) with D = G * M (every group full, its members consecutive, as
    # forks of one prompt decode): the [G, M] grid is then a view of the sequences, no scatter.
    members_in_order: bool = False
    # One query per sequence and the grid in batch order (query_index and token_cell are
    # aranges): the grid's rows are the decode tokens' rows, read and written in place.
    grid_is_batch: bool = False
    # [D] each sequence's group, member_index // group_size: derived once here, read by every
    # layer.
    group_of: torch.Tensor = field(init=False, repr=False)

    def __post_init__(self):
        group_of = torch.div(self.member_index, self.group_size, rounding_mode="floor")
        object.__setattr__(self, "group_of", group_of)

    @property
    def num_tokens(self) -> int:
        return self.token_cell.shape[0]


@dataclass(frozen=True)
class AttentionMetadata:
    out_slots: torch.Tensor  # [T] where each token's K/V is written
    decode: DecodeMetadata | None  # the first decode.num_seqs tokens are decode tokens
    prefill: tuple[PrefillSegment, ...]

    @property
    def num_decode(self) -> int:
        """Decode tokens (one per sequence, more when speculating) lead the batch."""
        return self.decode.num_tokens if self.decode is not None else 0


class TorchAttention:
    """Reference paged attention in plain torch: store new K/V, then attend. With `suffix_lanes`,
    decode suffixes are read from persistent lanes (see `rollout.suffix_lanes`) when the
    metadata says so."""

    def __init__(self, pool: KVPool, suffix_lanes: SuffixLanes | None = None):
        self.pool = pool
        self.suffix_lanes = suffix_lanes

    def forget_plan(self) -> None:
        """Nothing of a step is cached here (the suffix lanes are released with the pool); the
        Triton backend's twin drops its decode plan."""

    def forward(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        """q: [T, H, D]; k, v: [T, Hkv, D] for the batch's new tokens -> [T, H, D]."""
        k_cache, v_cache = self.pool.k[layer], self.pool.v[layer]  # [Hkv, slots, D]
        k, v = self.pool.store(layer, meta.out_slots, k, v)  # as held (dequantized if FP8)
        if meta.decode is not None and not meta.prefill:  # pure decode: no rows to merge
            return self._decode(layer, q, k, v, meta, k_cache, v_cache)
        out = torch.empty_like(q)
        if meta.decode is not None:
            out[: meta.num_decode] = self._decode(layer, q, k, v, meta, k_cache, v_cache)
        prefill_attention(
            q, k, v, k_cache, v_cache, meta.prefill, out, kv_scales=self.pool.scales(layer)
        )
        return out

    def _decode(self, layer, q, k, v, meta: AttentionMetadata, k_cache, v_cache) -> torch.Tensor:
        """Attention of the decode tokens (the batch's first `meta.num_decode` rows), their K/V
        already stored -> [num_decode, H, D]."""
        num_decode, suffix, prefix = meta.num_decode, None, None
        decode, page_size = meta.decode, self.pool.page_size
        if decode.lane_write is not None:
            lanes = self.suffix_lanes
            lanes.mirror(layer, decode.lane_write, k[:num_decode], v[:num_decode])
            num_seqs, width = decode.suffix_bias.shape[0], decode.suffix_bias.shape[-1]
            suffix = lanes.views(layer, num_seqs, width)
            if decode.prefix_key is not None and decode.prefix_pages.shape[1] > 0:
                prefix = lanes.prefix(layer, decode.prefix_key, decode.prefix_pages)
        return cascade_decode_attention(
            q[:num_decode],
            k_cache,
            v_cache,
            decode,
            page_size,
            suffix,
            prefix,
            kv_scales=self.pool.scales(layer),
        )


def prefill_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    segments: tuple[PrefillSegment, ...],
    out: torch.Tensor,
    kv_scales: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> None:
    """Each chunk attends causally over its cached prefix and itself; writes rows of `out`.
    q [T, H, D], k, v [T, Hkv, D]: the batch's tokens (their K/V also stored in the caches).
    `kv_scales`: an FP8 pool's K and V scales [Hkv] of this layer (`rollout.kv_quant`).

    A chunk without a cached prefix attends over its own new K/V, read from `k` / `v`;
    consecutive such chunks of one length (a batch of fresh prompts) form one batched causal
    call: of the C kernel (`rollout.native`, on CPU in float32 / bfloat16, q / k / v read in
    place) or else of SDPA. A chunk after a cached prefix gathers its context from the caches
    (`attend_after_prefix`)."""
    i = 0
    while i < len(segments):
        seg = segments[i]
        rows = slice(seg.token_start, seg.token_start + seg.num_new)
        if seg.prefix_len > 0:
            queries = q[rows].transpose(0, 1).unsqueeze(0)  # [1, H, n, D]
            attended = attend_after_prefix(
                queries, k_cache, v_cache, seg.context_slots, kv_scales=kv_scales
            )
            out[rows] = attended.squeeze(0).transpose(0, 1)
            i += 1
            continue
        j = i + 1  # the run [i, j) of adjacent prefix-free chunks of seg's length
        while (
            j < len(segments)
            and segments[j].prefix_len == 0
            and segments[j].num_new == seg.num_new
            and segments[j].token_start == seg.token_start + (j - i) * seg.num_new
        ):
            j += 1
        count, n = j - i, seg.num_new
        rows = slice(seg.token_start, seg.token_start + count * n)
        if (lib := _native_prefill(q)) is not None:  # [count, n, heads, D] views, in place
            queries, keys, values = (x[rows].unflatten(0, (count, n)) for x in (q, k, v))
            chunk_out = out[rows].unflatten(0, (count, n))
            native.prefill_attention(
                lib, queries, keys.transpose(1, 2), values.transpose(1, 2), chunk_out
            )
            i = j
            continue
        queries, keys, values = (_chunks(x[rows], count) for x in (q, k, v))
        attended = F.scaled_dot_product_attention(
            queries, keys, values, is_causal=True, enable_gqa=True
        )
        out[rows] = attended.transpose(1, 2).flatten(0, 1)
        i = j


def attend_after_prefix(
    queries: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    context_slots: torch.Tensor,
    per_head_kv: bool | None = None,
    kv_scales: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """queries [1, H, n, D], the last n tokens of a context of C slots (a cached prefix, then
    the chunk) -> [1, H, n, D]: query i attends context positions <= C - n + i. `kv_scales`:
    an FP8 pool's scales [Hkv]; the gathered K/V are dequantized to the queries' dtype.

    On a GPU SDPA has three kernels: flash takes no mask (only its own causal alignments) and
    memory-efficient takes no GQA (fewer K/V heads than query heads); anything else falls to
    the math kernel, which materialises the [H, n, C] scores. So there (`per_head_kv`, the
    default off the CPU) the K/V are gathered once per *query* head, and the causal offset is a
    lower-right-aligned `CausalBias`, which both kernels take without a mask tensor. On the CPU
    each K/V head is gathered once; in float32 / bfloat16 the C kernel (`rollout.native`)
    attends with the causal offset built in, else SDPA with a boolean mask and GQA."""
    num_heads, n = queries.shape[1], queries.shape[2]
    num_kv, context = k_cache.shape[0], context_slots.shape[0]
    if per_head_kv is None:
        per_head_kv = queries.device.type != "cpu"
    if per_head_kv:
        # imported here: the module imports torch._dynamo (seconds of CPU), which an engine on
        # the CPU never needs
        from torch.nn.attention.bias import causal_lower_right

        # query head h reads K/V head h // (H / Hkv): one gather per cache, [1, H, C, D]
        heads = torch.arange(num_heads, device=queries.device) // (num_heads // num_kv)
        keys, values = (
            _held(_rows_per_head(cache, heads, context_slots), scale, heads, queries)
            for cache, scale in zip((k_cache, v_cache), kv_scales or (None, None))
        )
        return F.scaled_dot_product_attention(
            queries, keys, values, attn_mask=causal_lower_right(n, context)
        )
    keys, values = (  # [1, Hkv, C, D]
        _held(index_select(cache, 1, context_slots), scale, None, queries)
        for cache, scale in zip((k_cache, v_cache), kv_scales or (None, None))
    )
    if (lib := _native_prefill(queries)) is not None:
        out = queries.new_empty(1, n, num_heads, queries.shape[-1])
        native.prefill_attention(lib, queries.transpose(1, 2), keys, values, out)
        return out.transpose(1, 2)
    positions = torch.arange(context, device=queries.device)
    mask = positions.unsqueeze(0) <= positions[context - n :].unsqueeze(-1)  # [n, C]
    return F.scaled_dot_product_attention(queries, keys, values, attn_mask=mask, enable_gqa=True)


def _native_prefill(q: torch.Tensor):
    """The C prefill attention kernel where it computes this attention (CPU, float32 or
    bfloat16, the kernel built), else None: the torch path (float64 stays there, exact)."""
    if q.device.type == "cpu" and q.dtype in native.PREFILL_DTYPES:
        return native.prefill()
    return None


def _rows_per_head(cache: torch.Tensor, heads: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """cache [Hkv, slots, D] -> [len(heads), len(slots), D], row h from KV head heads[h]
    (float8 through its bytes, as `index_select`)."""
    if cache.dtype == torch.float8_e4m3fn:
        return cache.view(torch.uint8)[heads.unsqueeze(-1), slots.unsqueeze(0)].view(cache.dtype)
    return cache[heads.unsqueeze(-1), slots.unsqueeze(0)]


def _held(
    gathered: torch.Tensor,
    scale: torch.Tensor | None,
    heads: torch.Tensor | None,
    queries: torch.Tensor,
) -> torch.Tensor:
    """Gathered cache rows [heads, C, D] -> [1, heads, C, D] in the queries' dtype: dequantized
    with `scale` [Hkv] (indexed by `heads`, the KV head of each row, when given) for an FP8
    pool, else as stored."""
    if scale is not None:
        scale = head_scale(scale if heads is None else scale[heads], 0, gathered.dim())
        gathered = dequantize(gathered, scale, queries.dtype)
    return gathered.unsqueeze(0)


def _chunks(x: torch.Tensor, count: int) -> torch.Tensor:
    """[count * n, heads, D] rows of `count` equal chunks -> [count, heads, n, D] (a view)."""
    return x.unflatten(0, (count, -1)).transpose(1, 2)


def _gather(
    cache: torch.Tensor,
    pages: torch.Tensor,
    page_size: int,
    scale: torch.Tensor | None = None,
    dtype: torch.dtype | None = None,
    as_stored: bool = False,
) -> torch.Tensor:
    """cache [Hkv, slots, D], pages [B, N] -> [Hkv, B, N * page_size, D] (contiguous) in
    `accum_dtype` of `dtype` (default the cache's), or in the cache's own dtype with
    `as_stored`; an FP8 cache is dequantized with its `scale` [Hkv].
    Whole pages are copied: contiguous runs make the gather close to memcpy speed."""
    num_kv_heads, _, head_dim = cache.shape
    paged = cache.view(num_kv_heads, -1, page_size * head_dim)
    gathered = index_select(paged, 1, pages.reshape(-1))
    gathered = gathered.view(num_kv_heads, pages.shape[0], pages.shape[1] * page_size, head_dim)
    if as_stored and scale is None:
        return gathered
    wide = accum_dtype(dtype or cache.dtype)
    if scale is not None:
        return dequantize(gathered, head_scale(scale, 0, 4), wide)
    return gathered.to(wide)


def _bmm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a [Hkv, B, m, k] @ b [Hkv, B, k, n] -> [Hkv, B, m, n], one `bmm` per KV head. Unlike
    `matmul`, this reads `b` in place when it is a strided view (suffix lanes), without a copy."""
    out = a.new_empty(*a.shape[:-1], b.shape[-1])
    for h in range(a.shape[0]):
        torch.bmm(a[h], b[h], out=out[h])
    return out


def cascade_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: DecodeMetadata,
    page_size: int,
    suffix_kv: tuple[torch.Tensor, torch.Tensor] | None = None,
    prefix_kv: tuple[torch.Tensor, torch.Tensor] | None = None,
    kv_scales: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Exact softmax attention of each decode query over (group prefix ++ own suffix).

    q: [T, H, Dh] decode tokens in batch order -> [T, H, Dh]. Heads are grouped GQA-style:
    query head h reads KV head h // (H / Hkv). `suffix_kv`: the suffix K, V already laid out as
    [Hkv, D, Ls, Dh] in grid order, `accum_dtype` (suffix lanes); None gathers them from the
    pool. `prefix_kv`: the groups' prefix K, V as [Hkv, G, Lp, Dh], `accum_dtype` (kept across
    steps by the lanes); None gathers them. `kv_scales`: an FP8 pool's K and V scales [Hkv];
    the gathers dequantize, so every path below reads float K/V. Where the C kernel runs, a
    bfloat16 pool's K/V stay bfloat16 (gathered and kept in lanes as stored, `decode_kv_dtype`):
    the kernel widens each row as it reads it.

    On CPU, in float32 and bfloat16, one C kernel computes both parts in one softmax per
    (sequence, KV head) (`rollout.native`); in float64, or without that kernel, the two parts
    run through torch's fused flash-attention kernel and are merged by their log-sum-exps
    (`cascade_decode_attention_flash`); elsewhere as explicit matrix products and one softmax
    (`cascade_decode_attention_matmul`, the reference all are tested against).
    """
    k_scale, v_scale = kv_scales or (None, None)
    lib = _native_decode(q)
    as_stored = lib is not None and k_cache.dtype == torch.bfloat16
    if suffix_kv is None:
        suffix_kv = (
            _gather(k_cache, meta.suffix_pages, page_size, k_scale, q.dtype, as_stored),
            _gather(v_cache, meta.suffix_pages, page_size, v_scale, q.dtype, as_stored),
        )
    if prefix_kv is None and meta.prefix_pages.shape[1] > 0:
        prefix_kv = (
            _gather(k_cache, meta.prefix_pages, page_size, k_scale, q.dtype, as_stored),
            _gather(v_cache, meta.prefix_pages, page_size, v_scale, q.dtype, as_stored),
        )
    if lib is not None:
        return cascade_decode_attention_native(lib, q, meta, suffix_kv, prefix_kv)
    wide = accum_dtype(q.dtype)  # the torch paths read float K/V
    suffix_kv = tuple(t.to(wide) for t in suffix_kv)
    prefix_kv = None if prefix_kv is None else tuple(t.to(wide) for t in prefix_kv)
    if q.device.type != "cpu":
        return cascade_decode_attention_matmul(q, meta, suffix_kv, prefix_kv)
    return cascade_decode_attention_flash(q, meta, suffix_kv, prefix_kv)


def _native_decode(q: torch.Tensor):
    """The C decode attention kernel where it computes this attention (CPU, float32 or
    bfloat16 queries, the kernel built), else None."""
    if q.device.type == "cpu" and accum_dtype(q.dtype) == torch.float32:
        return native.attention()
    return None


def decode_kv_dtype(pool: KVPool) -> torch.dtype:
    """The dtype decode attention reads `pool`'s K/V in (what the suffix lanes hold): a
    bfloat16 pool's own on the CPU where the C kernel reads its rows as stored (half the bytes
    of a float32 copy, and no widening pass), else `accum_dtype`."""
    if pool.k.dtype == torch.bfloat16 and pool.k.device.type == "cpu":
        if native.attention() is not None:
            return torch.bfloat16
    return accum_dtype(pool.dtype)


def _grid_queries(q: torch.Tensor, meta: DecodeMetadata, num_kv_heads: int) -> torch.Tensor:
    """Decode queries [T, H, Dh] (batch order) -> the [D, Q] grid as [D, Hkv, Q * g, Dh] in
    `accum_dtype`: rows of a sequence ordered (query, head in the KV group)."""
    num_heads, head_dim = q.shape[1:]
    num_seqs, num_queries = meta.suffix_bias.shape[:2]
    per_kv = num_heads // num_kv_heads
    q = q.to(accum_dtype(q.dtype)).index_select(0, meta.query_index)
    q = q.view(num_seqs, num_queries, num_kv_heads, per_kv, head_dim).transpose(1, 2)
    return q.reshape(num_seqs, num_kv_heads, num_queries * per_kv, head_dim)


def _grid_output(out: torch.Tensor, meta: DecodeMetadata, dtype: torch.dtype) -> torch.Tensor:
    """[D, Hkv, Q * g, Dh] grid rows -> [T, H, Dh] decode tokens in batch order, `dtype`."""
    num_seqs, num_kv_heads, _, head_dim = out.shape
    num_queries = meta.suffix_bias.shape[1]
    out = out.view(num_seqs, num_kv_heads, num_queries, -1, head_dim).transpose(1, 2)
    out = out.reshape(num_seqs * num_queries, -1, head_dim).index_select(0, meta.token_cell)
    return out.to(dtype)


def cascade_decode_attention_native(
    lib,
    q: torch.Tensor,
    meta: DecodeMetadata,
    suffix_kv: tuple[torch.Tensor, torch.Tensor],
    prefix_kv: tuple[torch.Tensor, torch.Tensor] | None,
) -> torch.Tensor:
    """`cascade_decode_attention` on CPU in float32 through the C kernel `rollout.native`: each
    (sequence, KV head) attends over its group's prefix and its own suffix in one softmax, K and
    V read in place (the suffix lanes' strided views included). The many small products of the
    decode shape cost torch's flash kernel more in per-call set-up than in arithmetic."""
    num_kv_heads = suffix_kv[0].shape[0]
    if meta.grid_is_batch:  # the kernel reads the q heads in place and writes the token rows
        grid_q = q.to(torch.float32).unflatten(1, (num_kv_heads, -1))
    else:
        grid_q = _grid_queries(q, meta, num_kv_heads)
    out = native.cascade_decode(
        lib, grid_q, suffix_kv, meta.suffix_bias, prefix_kv, meta.prefix_bias, meta.group_of
    )
    if meta.grid_is_batch:
        return out.view(q.shape).to(q.dtype)
    return _grid_output(out, meta, q.dtype)


def cascade_decode_attention_flash(
    q: torch.Tensor,
    meta: DecodeMetadata,
    suffix_kv: tuple[torch.Tensor, torch.Tensor],
    prefix_kv: tuple[torch.Tensor, torch.Tensor] | None,
) -> torch.Tensor:
    """`cascade_decode_attention` on CPU: the suffix part (each sequence's queries over its own
    suffix) and the prefix part (each group's queries, all members together, over the group's
    prefix) are each one call of torch's flash-attention kernel, which returns the output
    normalised over its part and that part's log-sum-exp `lse`. The softmax over the union is
    then exact: out = (o_s e^(lse_s - m) + o_p e^(lse_p - m)) / (e^(lse_s - m) + e^(lse_p - m)),
    m = max(lse_s, lse_p). A group with an empty prefix gets lse_p = -inf (the kernel reports 0
    for a fully masked row), so its weight is exactly 0.

    One fused kernel per part reads K and V once and keeps the scores in cache, where the
    matmul path writes [Hkv, D, Q * g, L] scores and probabilities to memory between many
    small batched products."""
    suffix_k, suffix_v = suffix_kv  # [Hkv, D, Ls, Dh]
    num_kv_heads, num_seqs = suffix_k.shape[:2]
    head_dim = q.shape[-1]
    scale = 1.0 / math.sqrt(head_dim)
    grid_q = _grid_queries(q, meta, num_kv_heads)  # [D, Hkv, Q*g, Dh]
    rows = grid_q.shape[2]
    num_queries = meta.suffix_bias.shape[1]
    per_kv = rows // num_queries
    suffix_bias = meta.suffix_bias.to(grid_q.dtype)  # [D, Q, Ls]
    suffix_mask = (  # [D, 1, Q*g or 1, Ls]: one query per sequence broadcasts over the heads
        suffix_bias.unsqueeze(1)
        if num_queries == 1
        else suffix_bias.unsqueeze(2).expand(-1, -1, per_kv, -1).reshape(num_seqs, 1, rows, -1)
    )
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        grid_q,
        suffix_k.transpose(0, 1),
        suffix_v.transpose(0, 1),
        attn_mask=suffix_mask,
        scale=scale,
    )
    if prefix_kv is None:
        return _grid_output(out, meta, q.dtype)
    prefix_k, prefix_v = prefix_kv  # [Hkv, G, Lp, Dh]
    groups, members = prefix_k.shape[1], meta.group_size
    if meta.members_in_order:  # the [G, M] grid is the sequences themselves
        member_q = grid_q.view(groups, members, num_kv_heads, rows, head_dim)
    else:
        group_of = meta.group_of
        slot_of = meta.member_index - group_of * members
        # Queries into the [G, M] grid (empty cells stay zero; their rows are never read back).
        member_q = grid_q.new_zeros(groups, members, num_kv_heads, rows, head_dim)
        member_q[group_of, slot_of] = grid_q
    member_q = member_q.transpose(1, 2).reshape(groups, num_kv_heads, members * rows, head_dim)
    prefix_bias = meta.prefix_bias.to(grid_q.dtype)
    prefix_out, prefix_lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        member_q,
        prefix_k.transpose(0, 1),
        prefix_v.transpose(0, 1),
        attn_mask=prefix_bias[:, None, None, :],
        scale=scale,
    )
    prefix_lse = prefix_lse.masked_fill(
        torch.isneginf(prefix_bias[:, :1]).unsqueeze(-1), float("-inf")
    )  # [G, Hkv, M*rows]
    prefix_out = prefix_out.view(groups, num_kv_heads, members, rows, head_dim).transpose(1, 2)
    prefix_lse = prefix_lse.view(groups, num_kv_heads, members, rows).transpose(1, 2)
    if meta.members_in_order:  # grid cell i is sequence i: a reshape instead of gathers
        # (the same contiguous layout as the gathers', so the merge below rounds alike:
        # vectorised and scalar exp may differ in the last bit)
        prefix_out = prefix_out.reshape(num_seqs, num_kv_heads, rows, head_dim)
        prefix_lse = prefix_lse.reshape(num_seqs, num_kv_heads, rows)
    else:
        prefix_out, prefix_lse = prefix_out[group_of, slot_of], prefix_lse[group_of, slot_of]
    top = torch.maximum(lse, prefix_lse)  # finite: a query always sees its own token
    w_suffix = torch.exp(lse - top).unsqueeze(-1)
    w_prefix = torch.exp(prefix_lse - top).unsqueeze(-1)
    merged = (out * w_suffix + prefix_out * w_prefix) / (w_suffix + w_prefix)
    return _grid_output(merged, meta, q.dtype)


def cascade_decode_attention_matmul(
    q: torch.Tensor,
    meta: DecodeMetadata,
    suffix_kv: tuple[torch.Tensor, torch.Tensor],
    prefix_kv: tuple[torch.Tensor, torch.Tensor] | None,
) -> torch.Tensor:
    """`cascade_decode_attention` as explicit batched matrix products and one softmax over
    prefix ++ suffix scores (any device; the reference of the flash path)."""
    num_heads, head_dim = q.shape[1:]
    out_dtype = q.dtype
    num_seqs, num_queries = meta.suffix_bias.shape[:2]
    num_kv_heads = suffix_kv[0].shape[0]
    per_kv = num_heads // num_kv_heads
    rows = num_queries * per_kv  # score rows per sequence, ordered (query, head in KV group)
    # float32 (at least) scores and softmax whatever the model dtype (a no-op for float32)
    q = (q.to(accum_dtype(q.dtype)) * (1.0 / math.sqrt(head_dim))).index_select(0, meta.query_index)
    q = q.view(num_seqs, num_queries, num_kv_heads, per_kv, head_dim).permute(2, 0, 1, 3, 4)
    q = q.reshape(num_kv_heads, num_seqs, rows, head_dim)  # [Hkv, D, Q*g, Dh]

    # Own suffix, causal among this step's queries: [Hkv, D, Q*g, Ls]
    suffix_bias = (
        meta.suffix_bias.unsqueeze(2).expand(-1, -1, per_kv, -1).reshape(1, num_seqs, rows, -1)
    )
    suffix_k, suffix_v = suffix_kv
    suffix_scores = _bmm(q, suffix_k.transpose(-1, -2)) + suffix_bias
    row_max = suffix_scores.amax(-1, keepdim=True)  # finite: a query always sees its own token

    has_prefix = prefix_kv is not None
    if has_prefix:
        groups, members = meta.prefix_pages.shape[0], meta.group_size
        # Queries into the [G, M] grid (empty cells stay zero and are never read back).
        grid_q = q.new_zeros(num_kv_heads, groups * members, rows, head_dim)
        grid_q.index_copy_(1, meta.member_index, q)
        grid_q = grid_q.view(num_kv_heads, groups, members * rows, head_dim)
        prefix_k, prefix_v = prefix_kv  # [Hkv, G, Lp, Dh]
        grid_scores = grid_q @ prefix_k.transpose(-1, -2) + meta.prefix_bias[None, :, None, :]
        prefix_scores = grid_scores.view(num_kv_heads, groups * members, rows, -1).index_select(
            1, meta.member_index
        )
        row_max = torch.maximum(row_max, prefix_scores.amax(-1, keepdim=True))

    suffix_p = torch.exp(suffix_scores - row_max)
    denom = suffix_p.sum(-1, keepdim=True)
    out = _bmm(suffix_p, suffix_v)  # [Hkv, D, Q*g, Dh]
    if has_prefix:
        prefix_p = torch.exp(prefix_scores - row_max)
        denom = denom + prefix_p.sum(-1, keepdim=True)
        grid_p = prefix_p.new_zeros(num_kv_heads, groups * members, rows, prefix_p.shape[-1])
        grid_p.index_copy_(1, meta.member_index, prefix_p)
        grid_out = grid_p.view(num_kv_heads, groups, members * rows, -1) @ prefix_v
        out = out + grid_out.view(num_kv_heads, groups * members, rows, head_dim).index_select(
            1, meta.member_index
        )
    out = (
        (out / denom)
        .view(num_kv_heads, num_seqs, num_queries, per_kv, head_dim)
        .permute(1, 2, 0, 3, 4)
    )
    out = out.reshape(num_seqs * num_queries, num_heads, head_dim).index_select(0, meta.token_cell)
    return out.to(out_dtype)

"""Paged decode attention, split-K (flash-decoding), plain and shared-prefix (cascade).

Computes the same function as `rollout.attention.cascade_decode_attention`: for every decode
token, an exact softmax over (its sequence's group prefix ++ the visible part of its own suffix),
in float32 whatever the pool dtype, with GQA (query head h reads KV head h // (H / Hkv)). A
sequence has 1 to Q query tokens (its pending token, plus drafts when speculating), each with its
own (causal) mask over the suffix.

Work is cut in *phases* and *splits*. A phase is a set of contexts, each a row of a page table
read by the query rows of its members: the cascade prefix phase has one context per group whose
members are the group's sequences (so a prefix page is read once for all of them, as in the
reference), the suffix phase has one context per sequence. A program takes all query rows
(member x query token x query head of the KV group) that read its context's KV head, so each
K/V tile it loads serves all of them (rows beyond MAX_BLOCK_Q go to further row-block programs).
Each context is cut into chunks of `chunk_tokens` tokens processed by separate programs
(split-K), so a batch of a few long sequences still fills the GPU. A program computes, for its
query rows over its chunk, the chunk-local softmax statistics; a second kernel merges all chunks
of all phases per (decode token, head) with a log-sum-exp reduction. Partial results are kept
per query *cell* (sequence b, query j) of the padded [B, Q] grid of `DecodeMetadata`; the merge
reads the cell of each decode token.

Why the merge is exact. A chunk s covering tokens J_s stores lse_s = log sum_{j in J_s} e^{x_j}
(computed as m_s + log l_s with m_s its running max) and o_s = sum_{j in J_s} e^{x_j - lse_s} v_j.
With M = max_s lse_s, sum_s e^{lse_s - M} o_s = sum_j e^{x_j - M} v_j and
sum_s e^{lse_s - M} = sum_j e^{x_j - M}: their ratio is softmax(x) @ v over the union of the
chunks, the same number as one pass over the whole context, up to float32 rounding. An empty
chunk (past the context's length, or fully masked) has lse = -inf and weight 0.

Numerics. Scores, softmax and accumulation are float32. For a float32 pool the dots run in IEEE
float32 (not TF32, which would lose ~3 decimal digits). For a 16-bit pool the QK dot runs on the
native 16-bit inputs with float32 accumulation (products of 16-bit floats are exact in float32),
the PV dot takes the probabilities rounded to the pool dtype, as flash attention does; the
reference keeps them in float32, so 16-bit results agree to 16-bit tolerance, not bitwise.
The Triton interpreter (TRITON_INTERPRET=1) cannot multiply bfloat16 in `tl.dot` (triton issue
11584), so there bfloat16 operands are upcast to float32 instead (float16 keeps the native path).
An FP8 pool (float8_e4m3fn, `kv_scales` per KV head: `rollout.kv_quant`) is dequantized to the
queries' dtype as it is loaded, exactly (power-of-two scales), and then attended as above.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.runtime.jit import JITFunction

from rollout.attention import DecodeMetadata

MAX_SPLITS_PER_PHASE = 64  # bounds the partial buffers and the merge's work
MAX_BLOCK_Q = 64  # query rows per program: acc is [BLOCK_Q, D] float32 in registers
MIN_BLOCK = 16  # tl.dot needs every dimension >= 16
# The merge kernel holds a [BLOCK_H, BLOCK_S, BLOCK_D] float32 tile of partial outputs: heads
# go to separate programs MERGE_BLOCK_H at a time and splits are merged MERGE_BLOCK_S per
# iteration, so the tile stays 4 x 4 x head_dim whatever the model (28 heads at once would
# spill registers).
MERGE_BLOCK_H = 4
MERGE_BLOCK_S = 4


@triton.jit
def _partial_attention_kernel(
    q_ptr,  # [T, H, D] decode query tokens
    query_index_ptr,  # [B * Q] token row of each query cell (sequence b, query j)
    k_cache_ptr,
    v_cache_ptr,  # one layer of the pool: [Hkv, slots, D]
    k_scale_ptr,
    v_scale_ptr,  # [Hkv] float32 scales of an FP8 pool (if KV_FP8)
    pages_ptr,  # [C, N] page ids of each context
    bias_ptr,  # [C, Q or 1, N * PAGE_SIZE] float32 additive mask (if HAS_BIAS)
    lengths_ptr,  # [C] tokens to read; columns past it are not read at all
    members_ptr,  # [C, num_members] sequence reading each context, -1 = none
    part_out_ptr,
    part_lse_ptr,  # [B * Q, H, S, D], [B * Q, H, S] float32 per-chunk results
    stride_qt,
    stride_qh,
    stride_kh,
    stride_ks,
    stride_vh,
    stride_vs,
    stride_pages,
    stride_bias,
    stride_bias_q,
    stride_members,
    stride_pos,
    stride_poh,
    stride_pok,
    stride_pls,
    stride_plh,
    num_members,
    num_queries,
    num_row_blocks,
    width,
    split_offset,
    chunk_tokens,
    scale,
    PAGE_SIZE: tl.constexpr,
    PER_KV: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    NATIVE_DOT: tl.constexpr,
    KV_FP8: tl.constexpr,
):
    ctx = tl.program_id(0).to(tl.int64)
    kv_head = (tl.program_id(1) // num_row_blocks).to(tl.int64)
    row_block = tl.program_id(1) % num_row_blocks
    split = tl.program_id(2)

    # Query rows of this program, ordered (member, query, head of the KV group): every query
    # head of every query token of every member that reads this KV head of this context.
    rows = row_block * BLOCK_Q + tl.arange(0, BLOCK_Q)
    member = rows // (num_queries * PER_KV)
    query = (rows // PER_KV) % num_queries
    head = kv_head * PER_KV + rows % PER_KV
    seq = tl.load(
        members_ptr + ctx * stride_members + member, mask=member < num_members, other=-1
    ).to(tl.int64)
    row_ok = seq >= 0  # padding rows (empty grid cells, tile tail) are never stored
    cell = seq * num_queries + query  # the (sequence, query) cell this row's results belong to
    token = tl.load(query_index_ptr + cell, mask=row_ok, other=0).to(tl.int64)
    dims = tl.arange(0, BLOCK_D)
    dim_ok = dims < HEAD_DIM
    q = tl.load(
        q_ptr + token[:, None] * stride_qt + head[:, None] * stride_qh + dims[None, :],
        mask=row_ok[:, None] & dim_ok[None, :],
        other=0.0,
    )
    if not NATIVE_DOT:
        q = q.to(tl.float32)

    length = tl.minimum(
        tl.load(lengths_ptr + ctx).to(tl.int32), width
    )  # never read past the page table
    start = split * chunk_tokens
    end = tl.minimum(start + chunk_tokens, length)

    m_i = tl.full([BLOCK_Q], float("-inf"), tl.float32)  # running max of the scores
    l_i = tl.zeros([BLOCK_Q], tl.float32)  # running sum of e^{score - m_i}
    acc = tl.zeros([BLOCK_Q, BLOCK_D], tl.float32)  # running sum of e^{score - m_i} v
    for block_start in range(start, end, BLOCK_N):
        toks = block_start + tl.arange(0, BLOCK_N)
        tok_ok = toks < end
        # One page lookup per token: any page size works, and a page of P >= BLOCK_N tokens
        # (or a run of consecutive pages) gives contiguous rows of D elements.
        page = tl.load(pages_ptr + ctx * stride_pages + toks // PAGE_SIZE, mask=tok_ok, other=0).to(
            tl.int64
        )
        slots = page * PAGE_SIZE + toks % PAGE_SIZE
        kv_mask = tok_ok[:, None] & dim_ok[None, :]
        k = tl.load(
            k_cache_ptr + kv_head * stride_kh + slots[:, None] * stride_ks + dims[None, :],
            mask=kv_mask,
            other=0.0,
        )
        v = tl.load(
            v_cache_ptr + kv_head * stride_vh + slots[:, None] * stride_vs + dims[None, :],
            mask=kv_mask,
            other=0.0,
        )
        if KV_FP8:  # dequantize to the queries' dtype: exact (power-of-two scales)
            k = (k.to(tl.float32) * tl.load(k_scale_ptr + kv_head)).to(q_ptr.dtype.element_ty)
            v = (v.to(tl.float32) * tl.load(v_scale_ptr + kv_head)).to(q_ptr.dtype.element_ty)
        if NATIVE_DOT:
            scores = tl.dot(q, tl.trans(k))
        else:
            scores = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision="ieee")
        scores = scores * scale
        if HAS_BIAS:  # per query row (stride_bias_q = 0 when all queries share one mask)
            scores += tl.load(
                bias_ptr + ctx * stride_bias + query[:, None] * stride_bias_q + toks[None, :],
                mask=row_ok[:, None] & tok_ok[None, :],
                other=0.0,
            )
        scores = tl.where(tok_ok[None, :], scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, 1))
        # A row that has seen only masked tokens keeps m = -inf; shifting by 0 then gives
        # e^{-inf} = 0 instead of e^{-inf - (-inf)} = NaN.
        m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m_i - m_shift)
        p = tl.exp(scores - m_shift[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        if NATIVE_DOT:
            pv = tl.dot(p.to(v.dtype), v)
        else:
            pv = tl.dot(p, v.to(tl.float32), input_precision="ieee")
        acc = acc * alpha[:, None] + pv
        m_i = m_new

    seen = l_i > 0.0
    lse = tl.where(seen, m_i + tl.log(tl.where(seen, l_i, 1.0)), float("-inf"))
    out = acc / tl.where(seen, l_i, 1.0)[:, None]  # 0 for an empty chunk
    col = split_offset + split
    tl.store(
        part_out_ptr
        + cell[:, None] * stride_pos
        + head[:, None] * stride_poh
        + col * stride_pok
        + dims[None, :],
        out,
        mask=row_ok[:, None] & dim_ok[None, :],
    )
    tl.store(part_lse_ptr + cell * stride_pls + head * stride_plh + col, lse, mask=row_ok)


@triton.jit
def _merge_kernel(
    part_out_ptr,
    part_lse_ptr,  # [B * Q, H, S, D], [B * Q, H, S] float32
    token_cell_ptr,  # [T] query cell of each decode token
    out_ptr,  # [T, H, D] in the query dtype
    stride_pos,
    stride_poh,
    stride_pok,
    stride_pls,
    stride_plh,
    stride_ot,
    stride_oh,
    num_splits,
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_S: tl.constexpr,
):
    # One program per (decode token, block of BLOCK_H heads): the tile of partial outputs is
    # [BLOCK_H, BLOCK_S, BLOCK_D] (see MERGE_BLOCK_H).
    token = tl.program_id(0).to(tl.int64)
    cell = tl.load(token_cell_ptr + token).to(tl.int64)  # padding cells are never merged
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    dims = tl.arange(0, BLOCK_D)
    head_ok = heads < NUM_HEADS
    dim_ok = dims < HEAD_DIM
    m = tl.full([BLOCK_H], float("-inf"), tl.float32)
    denom = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    # Online merge, BLOCK_S chunks at a time: the same rescaling as in the partial kernel, with
    # e^{lse_s} standing for a chunk's sum of exponentials (see the module docstring).
    for s0 in range(0, num_splits, BLOCK_S):
        cols = s0 + tl.arange(0, BLOCK_S)
        lse_mask = head_ok[:, None] & (cols[None, :] < num_splits)
        lse = tl.load(
            part_lse_ptr + cell * stride_pls + heads[:, None] * stride_plh + cols[None, :],
            mask=lse_mask,
            other=float("-inf"),
        )  # [H, S]
        o = tl.load(
            part_out_ptr
            + cell * stride_pos
            + heads[:, None, None] * stride_poh
            + cols[None, :, None] * stride_pok
            + dims[None, None, :],
            mask=lse_mask[:, :, None] & dim_ok[None, None, :],
            other=0.0,
        )  # [H, S, D]
        m_new = tl.maximum(m, tl.max(lse, 1))
        m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        w = tl.exp(lse - m_shift[:, None])
        alpha = tl.exp(m - m_shift)
        denom = denom * alpha + tl.sum(w, 1)
        acc = acc * alpha[:, None] + tl.sum(w[:, :, None] * o, 1)
        m = m_new
    # A row with no visible token at all gets 0 (the reference gives NaN there); decode rows
    # always see at least their own token.
    out = acc / tl.where(denom > 0.0, denom, 1.0)[:, None]
    tl.store(
        out_ptr + token * stride_ot + heads[:, None] * stride_oh + dims[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=head_ok[:, None] & dim_ok[None, :],
    )


INTERPRETED = not isinstance(_partial_attention_kernel, JITFunction)
"""True when TRITON_INTERPRET=1 was set when this module was imported (kernels run in numpy)."""


@dataclass(frozen=True)
class Phase:
    """Contexts, each read by a few decode sequences: context c is row c of `pages`, of which the
    first `lengths[c]` tokens are read (plus `bias[c]` added to the scores, if given), by the
    sequences `members[c]` (-1 = empty cell) with all their query tokens."""

    pages: torch.Tensor  # [C, N] int
    lengths: torch.Tensor  # [C] int, <= N * page_size
    members: torch.Tensor  # [C, M] int
    bias: torch.Tensor | None = (
        None  # [C, Q or 1, N * page_size] float32; 1 = shared by all queries
    )


@dataclass(frozen=True)
class DecodeQueries:
    """Where the query tokens are: sequence b's query j is token row query_index[b * Q + j] (a
    padding cell repeats a real query of its sequence); decode token t's results are those of
    cell token_cell[t]."""

    query_index: torch.Tensor  # [B * Q] int
    token_cell: torch.Tensor  # [T] int
    num_queries: int  # Q


@functools.cache
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def plan_splits(
    width: int,
    programs_per_split: int,
    block_n: int,
    device: torch.device,
    chunk_tokens: int | None = None,
) -> tuple[int, int]:
    """(splits, chunk_tokens) for contexts of `width` tokens.

    Depends only on shapes (no device sync, so it is CUDA-graph safe). By default, enough splits
    for about two programs per SM; chunks are a whole number of BLOCK_N blocks."""
    if width == 0:
        return 0, block_n
    if chunk_tokens is None:
        if device.type == "cuda":
            target = 2 * _num_sms(
                device.index if device.index is not None else torch.cuda.current_device()
            )
        else:
            target = 1
        splits = max(1, min(triton.cdiv(width, block_n), triton.cdiv(target, programs_per_split)))
        chunk_tokens = triton.cdiv(width, splits)
    chunk_tokens = triton.cdiv(chunk_tokens, block_n) * block_n
    if triton.cdiv(width, chunk_tokens) > MAX_SPLITS_PER_PHASE:
        chunk_tokens = triton.cdiv(triton.cdiv(width, MAX_SPLITS_PER_PHASE), block_n) * block_n
    return triton.cdiv(width, chunk_tokens), chunk_tokens


def default_block_n(device: torch.device) -> int:
    # 64 tokens x D <= 128 of K and of V per iteration fit registers/shared memory on current
    # GPUs; the interpreter runs numpy per block, where small blocks keep tests quick.
    return 64 if device.type == "cuda" and not INTERPRETED else MIN_BLOCK


def split_k_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_size: int,
    phases: list[Phase],
    queries: DecodeQueries,
    *,
    block_n: int | None = None,
    chunk_tokens: int | None = None,
    kv_scales: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Attention of each decode token of q [T, H, D] over the union of its sequence's contexts in
    `phases` (each sequence is a member of exactly one context per phase) -> [T, H, D].
    `kv_scales`: the K and V scales [Hkv] of an FP8 pool (float8_e4m3fn caches), dequantized
    as they are read."""
    if q.dim() != 3 or k_cache.dim() != 3 or k_cache.shape != v_cache.shape:
        raise ValueError(
            f"decode attention: q {tuple(q.shape)} must be [T, H, D] and caches "
            f"{tuple(k_cache.shape)}, {tuple(v_cache.shape)} [Hkv, slots, D]"
        )
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[0]
    if k_cache.shape[2] != head_dim or num_heads % num_kv_heads != 0:
        raise ValueError(
            f"decode attention: q {tuple(q.shape)} needs head_dim {k_cache.shape[2]} and a "
            f"multiple of Hkv={num_kv_heads} heads"
        )
    fp8 = kv_scales is not None
    if not (k_cache.dtype == v_cache.dtype) or (
        k_cache.dtype != (torch.float8_e4m3fn if fp8 else q.dtype)
    ):
        raise ValueError(
            f"decode attention: the pool dtype {k_cache.dtype} must be q's {q.dtype}, or "
            "float8_e4m3fn with kv_scales"
        )
    if fp8 and any(s.shape != (num_kv_heads,) or s.dtype != torch.float32 for s in kv_scales):
        raise ValueError(f"decode attention: kv_scales must be float32 [Hkv={num_kv_heads}]")
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("decode attention: the pool's head_dim must be contiguous")
    if queries.token_cell.shape != (num_tokens,):
        raise ValueError(
            f"decode attention: token_cell {tuple(queries.token_cell.shape)} "
            f"must be [T={num_tokens}]"
        )
    out = torch.empty_like(q)
    if num_tokens == 0:
        return out
    q = q if q.stride(-1) == 1 else q.contiguous()
    per_kv = num_heads // num_kv_heads
    num_cells = queries.query_index.shape[0]
    block_n = block_n or default_block_n(q.device)
    if block_n < MIN_BLOCK or block_n & (block_n - 1):
        raise ValueError(
            f"decode attention: block_n={block_n} must be a power of two >= {MIN_BLOCK}"
        )
    block_d = max(MIN_BLOCK, triton.next_power_of_2(head_dim))
    # See the module docstring: native 16-bit dots, except bfloat16 under the interpreter.
    native_dot = q.dtype in (torch.float16, torch.bfloat16) and not (
        INTERPRETED and q.dtype == torch.bfloat16
    )

    launches = []
    num_splits = 0
    for phase in phases:
        num_ctx, num_pages = phase.pages.shape
        rows = phase.members.shape[1] * queries.num_queries * per_kv
        block_q = min(MAX_BLOCK_Q, max(MIN_BLOCK, triton.next_power_of_2(rows)))
        row_blocks = triton.cdiv(rows, block_q)
        splits, chunk = plan_splits(
            num_pages * page_size,
            num_ctx * num_kv_heads * row_blocks,
            block_n,
            q.device,
            chunk_tokens,
        )
        if num_ctx == 0 or splits == 0:
            continue
        launches.append((phase, splits, chunk, block_q, row_blocks, num_splits))
        num_splits += splits
    if num_splits == 0:
        raise ValueError(
            "decode attention: every context is empty; each decode token sees at least itself"
        )

    # Invariant: every (cell, head, split) entry is written by exactly one program (each sequence
    # is one member of one context per phase, and each context launches all of its phase's
    # splits, empty ones included), so the buffers need no initialisation.
    part_out = torch.empty(
        num_cells, num_heads, num_splits, head_dim, dtype=torch.float32, device=q.device
    )
    part_lse = torch.empty(num_cells, num_heads, num_splits, dtype=torch.float32, device=q.device)
    for phase, splits, chunk, block_q, row_blocks, offset in launches:
        bias = phase.bias
        _partial_attention_kernel[(phase.pages.shape[0], num_kv_heads * row_blocks, splits)](
            q,
            queries.query_index,
            k_cache,
            v_cache,
            *(kv_scales if fp8 else (part_lse, part_lse)),  # never read without KV_FP8
            phase.pages,
            bias if bias is not None else phase.lengths,  # never read without HAS_BIAS
            phase.lengths,
            phase.members,
            part_out,
            part_lse,
            q.stride(0),
            q.stride(1),
            k_cache.stride(0),
            k_cache.stride(1),
            v_cache.stride(0),
            v_cache.stride(1),
            phase.pages.stride(0),
            bias.stride(0) if bias is not None else 0,
            bias.stride(1) if bias is not None and bias.shape[1] > 1 else 0,
            phase.members.stride(0),
            part_out.stride(0),
            part_out.stride(1),
            part_out.stride(2),
            part_lse.stride(0),
            part_lse.stride(1),
            phase.members.shape[1],
            queries.num_queries,
            row_blocks,
            phase.pages.shape[1] * page_size,
            offset,
            chunk,
            1.0 / math.sqrt(head_dim),
            PAGE_SIZE=page_size,
            PER_KV=per_kv,
            HEAD_DIM=head_dim,
            BLOCK_D=block_d,
            BLOCK_Q=block_q,
            BLOCK_N=block_n,
            HAS_BIAS=bias is not None,
            NATIVE_DOT=native_dot,
            KV_FP8=fp8,
        )
    block_h = min(MERGE_BLOCK_H, triton.next_power_of_2(num_heads))
    _merge_kernel[(num_tokens, triton.cdiv(num_heads, block_h))](
        part_out,
        part_lse,
        queries.token_cell,
        out,
        part_out.stride(0),
        part_out.stride(1),
        part_out.stride(2),
        part_lse.stride(0),
        part_lse.stride(1),
        out.stride(0),
        out.stride(1),
        num_splits,
        NUM_HEADS=num_heads,
        HEAD_DIM=head_dim,
        BLOCK_H=block_h,
        BLOCK_D=block_d,
        BLOCK_S=min(MERGE_BLOCK_S, triton.next_power_of_2(num_splits)),
    )
    return out


def triton_paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    lengths: torch.Tensor,
    page_size: int,
    *,
    block_n: int | None = None,
    chunk_tokens: int | None = None,
) -> torch.Tensor:
    """Plain per-sequence paged decode attention, one query token per sequence: q [B, H, D]
    attends to the first lengths[b] tokens of the pages page_table[b] ([B, N],
    lengths[b] <= N * page_size) -> [B, H, D]."""
    num_seqs = q.shape[0]
    if page_table.dim() != 2 or page_table.shape[0] != num_seqs or lengths.shape != (num_seqs,):
        raise ValueError(
            f"paged decode attention: page_table {tuple(page_table.shape)} "
            f"must be [B={num_seqs}, N] and lengths {tuple(lengths.shape)} [B]"
        )
    rows = torch.arange(num_seqs, device=q.device)
    return split_k_decode_attention(
        q,
        k_cache,
        v_cache,
        page_size,
        [Phase(page_table, lengths, rows.unsqueeze(1))],
        DecodeQueries(rows, rows, 1),
        block_n=block_n,
        chunk_tokens=chunk_tokens,
    )


def visible_lengths(bias: torch.Tensor) -> torch.Tensor:
    """[C, ..., W] additive mask -> [C]: one past the last column that is not -inf in any of the
    row's masks (0 if none). Earlier masked columns are still masked through the bias itself, so
    any mask is honoured; the length only lets programs skip the padded tail."""
    flat = bias.reshape(bias.shape[0], -1, bias.shape[-1])
    cols = torch.arange(1, bias.shape[-1] + 1, device=bias.device)
    if bias.shape[-1] == 0:
        return cols.new_zeros(bias.shape[0])
    return (cols * (flat != float("-inf"))).amax(-1).amax(-1)


def cascade_plan(meta: DecodeMetadata) -> tuple[list[Phase], DecodeQueries]:
    """The prefix phase (one context per group, read by its members) and the suffix phase (one
    context per sequence) of a DecodeMetadata, and where its queries are. Plain torch on device,
    no sync: build once per step and reuse for every layer."""
    num_seqs, num_queries = meta.suffix_bias.shape[:2]
    device = meta.member_index.device
    phases = []
    if meta.prefix_pages.shape[1] > 0:
        groups = meta.prefix_pages.shape[0]
        cell_to_seq = torch.full((groups * meta.group_size,), -1, dtype=torch.int64, device=device)
        cell_to_seq[meta.member_index] = torch.arange(num_seqs, device=device)
        prefix_bias = meta.prefix_bias.float().unsqueeze(1).contiguous()  # one mask for all queries
        phases.append(
            Phase(
                meta.prefix_pages,
                visible_lengths(prefix_bias),
                cell_to_seq.view(groups, meta.group_size),
                prefix_bias,
            )
        )
    suffix_bias = meta.suffix_bias.float().contiguous()
    phases.append(
        Phase(
            meta.suffix_pages,
            visible_lengths(suffix_bias),
            torch.arange(num_seqs, device=device).unsqueeze(1),
            suffix_bias,
        )
    )
    return phases, DecodeQueries(meta.query_index, meta.token_cell, num_queries)


def triton_cascade_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: DecodeMetadata,
    page_size: int,
    *,
    block_n: int | None = None,
    chunk_tokens: int | None = None,
    kv_scales: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Same function as `rollout.attention.cascade_decode_attention`: q [T, H, Dh] decode tokens
    in batch order -> [T, H, Dh]."""
    phases, queries = cascade_plan(meta)
    return split_k_decode_attention(
        q,
        k_cache,
        v_cache,
        page_size,
        phases,
        queries,
        block_n=block_n,
        chunk_tokens=chunk_tokens,
        kv_scales=kv_scales,
    )

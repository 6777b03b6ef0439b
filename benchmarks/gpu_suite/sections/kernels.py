"""Triton kernels against the torch reference on the device, then decode attention's bandwidth.

Checks, per (layout, dtype): the KV store (bitwise), plain paged decode, the cascade decode with
one query per sequence and with 4 (speculative verification), each also with small forced
chunks (many splits), and plain paged decode over a page table as wide as the decode graphs'
(`max_model_len` / page_size pages per row, garbage pages past each row's length). Layouts:
Qwen2.5-0.5B's (14 query / 2 KV heads of 64), Qwen2.5-7B's (28 / 4 heads of 128) and one
without GQA (8 / 8 heads of 128). Pools hold random values everywhere, so an unmasked read of
padding shows.

Timings (GPU only): Triton split-K vs the torch reference at batch 1, 8 and 64, 4096-token
contexts, bf16, Qwen2.5-0.5B's layout, plain and GRPO-shaped (groups of 8 sharing a half-context
prefix, read once per group); GB/s = K/V bytes that must be read / kernel time, L2 flushed
before each call.
"""

from __future__ import annotations

import sys
import time
from typing import NamedTuple

import torch

from benchmarks.gpu_suite.harness import REPO

# (atol, rtol) against the reference, which computes in float32 from the same inputs
TOLERANCES = {"float32": (1e-4, 1e-4), "float16": (2e-3, 4e-3), "bfloat16": (1e-2, 2e-2)}
PAGE = 16


class Layout(NamedTuple):
    name: str
    num_heads: int
    num_kv_heads: int
    head_dim: int


QWEN05B = Layout("qwen0.5b", 14, 2, 64)
QWEN7B = Layout("qwen7b", 28, 4, 128)
MHA128 = Layout("mha128", 8, 8, 128)
CASES = (
    (QWEN05B, "float32"),
    (QWEN05B, "bfloat16"),
    (QWEN7B, "bfloat16"),
    (QWEN7B, "float16"),
    (MHA128, "bfloat16"),
)
# Peak HBM bandwidth, GB/s, by device-name substring (vendor figures); first match wins.
PEAK_HBM_GBPS = (
    ("H200", 4800),
    ("H100 NVL", 3900),
    ("H100 PCIe", 2000),
    ("H100", 3350),
    ("GH200", 4000),
    ("B200", 8000),
    ("A100-SXM4-80GB", 2039),
    ("A100 80GB PCIe", 1935),
    ("A100", 1555),
    ("L40S", 864),
    ("L4", 300),
)


def run(ctx) -> dict:
    sys.path.append(str(REPO / "tests"))  # kernel_cases: the kernel tests' scenes
    device = torch.device(ctx.device)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False  # the reference in IEEE float32
    for layout, dtype in CASES:
        check_layout(ctx, layout, getattr(torch, dtype), device)
    peak = peak_hbm_gbps(device)
    return {"peak_hbm_gbps": peak, "decode_attention": timings(device, ctx.dry_run, peak)}


# -- scenes ------------------------------------------------------------------------------------
def make_pool(layout: Layout, num_pages: int, dtype, device, seed: int):
    g = torch.Generator(device=device).manual_seed(seed)
    shape = (layout.num_kv_heads, num_pages * PAGE, layout.head_dim)
    k = torch.randn(shape, generator=g, device=device).to(dtype)
    v = torch.randn(shape, generator=g, device=device).to(dtype)
    return k, v


def make_scene(layout, kind, batch, context, dtype, device, seed, num_queries=1, group=8):
    """(q, k_cache, v_cache, meta, kv_bytes) for a decode batch: `plain` (each sequence its own
    `context` tokens) or `grpo` (groups sharing a `context / 2` prefix)."""
    from kernel_cases import cascade_metadata

    g = torch.Generator().manual_seed(seed)
    if kind == "plain":
        groups = [(0, [context - num_queries]) for _ in range(batch)]
        unique_tokens = batch * context
    else:
        members = min(group, batch)
        prefix_pages = context // 2 // PAGE
        suffix = context - prefix_pages * PAGE
        groups = [(prefix_pages, [suffix - num_queries] * members) for _ in range(batch // members)]
        unique_tokens = batch // members * prefix_pages * PAGE + batch * suffix
    num_pages = sum(p + len(ms) * -(-(ms[0] + num_queries) // PAGE) for p, ms in groups) + 1
    meta = cascade_metadata(
        groups,
        PAGE,
        num_pages,
        g,
        num_queries=[[num_queries] * len(ms) for _, ms in groups],
        device=str(device),
    )
    k_cache, v_cache = make_pool(layout, num_pages, dtype, device, seed)
    q = torch.randn(meta.num_tokens, layout.num_heads, layout.head_dim, generator=g)
    q = q.to(device, dtype)
    kv_bytes = 2 * unique_tokens * layout.num_kv_heads * layout.head_dim * k_cache.element_size()
    return q, k_cache, v_cache, meta, kv_bytes


# -- checks ------------------------------------------------------------------------------------
def compare(ctx, name: str, dtype_name: str, got, want) -> bool:
    atol, rtol = TOLERANCES[dtype_name]
    got, want = got.float(), want.float()
    err = (got - want).abs()
    bad = int((err > atol + rtol * want.abs()).sum()) + int((~torch.isfinite(got)).sum())
    return ctx.check(
        name, bad == 0, max_abs_err=float(err.max()), atol=atol, rtol=rtol, bad_elements=bad
    )


def check_layout(ctx, layout: Layout, dtype, device) -> None:
    from rollout.attention import cascade_decode_attention
    from rollout.kernels import (
        triton_cascade_decode_attention,
        triton_paged_decode_attention,
        triton_store_kv,
    )

    from kernel_cases import plain_metadata

    tiny = device.type != "cuda"
    context, batch = (80, 4) if tiny else (2048, 64)
    dtype_name = str(dtype).removeprefix("torch.")
    tag = f"{layout.name}_{dtype_name}"

    # KV store: a prefill-sized batch of new tokens into random slots of a random pool
    k_cache, v_cache = make_pool(layout, 64 if tiny else 4096, dtype, device, seed=1)
    num_new = 24 if tiny else 4096
    slots = torch.randperm(k_cache.shape[1], device=device)[:num_new]
    k = torch.randn(num_new, *k_cache.shape[::2], device=device).to(dtype)
    v = torch.randn(num_new, *k_cache.shape[::2], device=device).to(dtype)
    want_k, want_v = k_cache.clone(), v_cache.clone()
    want_k.index_copy_(1, slots, k.transpose(0, 1))
    want_v.index_copy_(1, slots, v.transpose(0, 1))
    triton_store_kv(k, v, k_cache, v_cache, slots)
    exact = torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v)
    ctx.check(f"kv_store_{tag}", exact, tokens=num_new, bitwise=exact)

    # plain paged decode, lengths spread over (0, context]
    q, k_cache, v_cache, meta, _ = make_scene(
        layout, "plain", batch, context, dtype, device, seed=2
    )
    lengths = torch.randint(1, context + 1, (batch,), generator=torch.Generator().manual_seed(3))
    got = triton_paged_decode_attention(
        q, k_cache, v_cache, meta.suffix_pages, lengths.to(device), PAGE
    )
    want = cascade_decode_attention(
        q, k_cache, v_cache, plain_metadata(meta.suffix_pages, lengths.tolist(), PAGE), PAGE
    )
    compare(ctx, f"paged_decode_{tag}", dtype_name, got, want)

    # the decode graphs' layout: a page table covering max_model_len, random pages past the
    # row's length (the kernel must stop at the length, not at the table's width)
    max_len = 160 if tiny else 4096
    wide = torch.randint(0, k_cache.shape[1] // PAGE, (batch, max_len // PAGE), device=device)
    wide[:, : meta.suffix_pages.shape[1]] = meta.suffix_pages
    got = triton_paged_decode_attention(q, k_cache, v_cache, wide, lengths.to(device), PAGE)
    want = cascade_decode_attention(
        q, k_cache, v_cache, plain_metadata(wide, lengths.tolist(), PAGE), PAGE
    )
    compare(ctx, f"paged_decode_graph_width_{tag}", dtype_name, got, want)

    # cascade: default split plan and forced small chunks; 1 query per sequence, then 4
    for num_queries in (1, 4):
        q, k_cache, v_cache, meta, _ = make_scene(
            layout, "grpo", batch, context, dtype, device, seed=4, num_queries=num_queries
        )
        want = cascade_decode_attention(q, k_cache, v_cache, meta, PAGE)
        for chunk in (None, 64):
            got = triton_cascade_decode_attention(
                q, k_cache, v_cache, meta, PAGE, chunk_tokens=chunk
            )
            name = f"cascade_q{num_queries}" + ("_chunk64" if chunk else "") + f"_{tag}"
            compare(ctx, name, dtype_name, got, want)


# -- timings -----------------------------------------------------------------------------------
def peak_hbm_gbps(device) -> float | None:
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((float(gbps) for key, gbps in PEAK_HBM_GBPS if key in name), None)


def time_ms(fn, device, reps: int) -> float:
    """Median ms of fn() with CUDA events, L2 flushed (a 256 MB write) before each call; on CPU
    one call (the interpreter's time means nothing; it shows the path runs)."""
    if device.type != "cuda":
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3
    fn()  # Triton compiles on the first call
    flush = torch.empty(256 << 20, dtype=torch.int8, device=device)
    times = []
    for _ in range(reps):
        flush.zero_()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def timings(device, tiny: bool, peak_gbps: float | None) -> list[dict]:
    from rollout.attention import cascade_decode_attention
    from rollout.kernels import cascade_plan, split_k_decode_attention

    context = 32 if tiny else 4096
    rows = []
    for kind in ("plain", "grpo"):
        for batch in (2, 4) if tiny else (1, 8, 64):
            if kind == "grpo" and batch == 1:
                continue
            q, k, v, meta, kv_bytes = make_scene(
                QWEN05B, kind, batch, context, torch.bfloat16, device, seed=10 + batch
            )
            phases, queries = cascade_plan(meta)  # once per step in the engine, not per layer
            triton_ms = time_ms(
                lambda q=q, k=k, v=v, p=phases, qs=queries: split_k_decode_attention(
                    q, k, v, PAGE, p, qs
                ),
                device,
                reps=20,
            )
            torch_ms = time_ms(
                lambda q=q, k=k, v=v, m=meta: cascade_decode_attention(q, k, v, m, PAGE),
                device,
                reps=5,
            )
            gbps = kv_bytes / (triton_ms * 1e-3) / 1e9
            rows.append(
                {
                    "kind": kind,
                    "batch": batch,
                    "context": context,
                    "kv_bytes": kv_bytes,
                    "triton_ms": round(triton_ms, 4),
                    "torch_ms": round(torch_ms, 4),
                    "speedup_vs_torch": round(torch_ms / triton_ms, 2),
                    "triton_gbps": round(gbps, 1),
                    "triton_frac_of_peak": round(gbps / peak_gbps, 3) if peak_gbps else None,
                }
            )
    return rows

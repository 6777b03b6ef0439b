"""GPU suite, kernel part: checks the Triton kernels against the torch reference on the device,
then times decode attention (Triton split-K vs the torch reference) against the HBM roofline.

    benchmarks/gpu_suite.sh              # on a CUDA machine; well under 8 minutes
    benchmarks/gpu_suite.sh --dry-run    # same code on CPU, TRITON_INTERPRET=1, tiny sizes

Layout timed: one attention layer of Qwen2.5-0.5B (14 query heads, 2 KV heads, head_dim 64),
bfloat16 pool, 16-token pages, one query token per sequence, at batch 1, 8 and 64:
  plain  every sequence reads its own context of `context` tokens;
  grpo   groups of 8 samples share a `context / 2`-token prompt prefix (cascade: read once per
         group) and each reads its own `context / 2`-token suffix.
Bytes are the K/V bytes the attention must read at least once (a shared prefix counts once);
GB/s = bytes / kernel time, with L2 flushed before every timed call.

Prints one JSON object; exits 1 if any kernel disagrees with the reference.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

# Peak HBM bandwidth, GB/s, by device-name substring (vendor figures); first match wins.
PEAK_HBM_GBPS = (
    ("H200", 4800), ("H100 NVL", 3900), ("H100 PCIe", 2000), ("H100", 3350), ("GH200", 4000),
    ("B200", 8000), ("A100-SXM4-80GB", 2039), ("A100 80GB PCIe", 1935), ("A100", 1555),
    ("L40S", 864), ("L40", 864), ("A10G", 600), ("L4", 300), ("RTX 4090", 1008),
)

QWEN_05B = dict(num_heads=14, num_kv_heads=2, head_dim=64)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dry-run", action="store_true", help="CPU, Triton interpreter, tiny sizes (checks the script)")
    p.add_argument("--context", type=int, default=None, help="tokens per sequence in the timings (default 4096)")
    p.add_argument("--json-out", type=Path, default=None, help="also write the JSON object to this file")
    return p.parse_args()


def main() -> int:
    args = parse_args()
    if args.dry_run:
        # Must precede the first import of rollout.kernels: Triton picks interpret vs compile
        # when the kernels are decorated.
        os.environ["TRITON_INTERPRET"] = "1"
    sys.path.insert(0, str(REPO))
    sys.path.insert(0, str(REPO / "tests" / "kernels"))
    import torch

    if not args.dry_run and not torch.cuda.is_available():
        print(json.dumps({"ok": False, "error": "no CUDA device; use --dry-run to exercise the script on CPU"}))
        return 2
    device = torch.device("cpu" if args.dry_run else "cuda")
    if device.type == "cuda":
        # The reference's float32 matmuls must be IEEE float32, as on CPU.
        torch.backends.cuda.matmul.allow_tf32 = False
    report = {
        "suite": "gpu_suite/kernels",
        "dry_run": args.dry_run,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (Triton interpreter)",
        "torch": torch.__version__,
    }
    import triton
    report["triton"] = triton.__version__
    report["peak_hbm_gbps"] = peak_hbm_gbps(device)

    started = time.perf_counter()
    report["checks"] = run_checks(device, tiny=args.dry_run)
    report["decode_attention"] = run_timings(device, tiny=args.dry_run, context=args.context,
                                             peak_gbps=report["peak_hbm_gbps"])
    report["seconds"] = round(time.perf_counter() - started, 1)
    report["ok"] = all(c["ok"] for c in report["checks"])
    text = json.dumps(report)
    print(text)
    if args.json_out is not None:
        args.json_out.write_text(text + "\n")
    return 0 if report["ok"] else 1


def peak_hbm_gbps(device) -> float | None:
    import torch

    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key, gbps in PEAK_HBM_GBPS:
        if key in name:
            return float(gbps)
    props = torch.cuda.get_device_properties(device)
    clock_khz, bus_bits = getattr(props, "memory_clock_rate", None), getattr(props, "memory_bus_width", None)
    if clock_khz and bus_bits:   # double data rate
        return 2 * clock_khz * 1e3 * bus_bits / 8 / 1e9
    return None


# -- scenes ------------------------------------------------------------------------------------
def make_pool(num_pages: int, page_size: int, dtype, device, seed: int):
    import torch

    g = torch.Generator(device=device).manual_seed(seed)
    shape = (QWEN_05B["num_kv_heads"], num_pages * page_size, QWEN_05B["head_dim"])
    k = torch.randn(shape, generator=g, device=device).to(dtype)
    v = torch.randn(shape, generator=g, device=device).to(dtype)
    return k, v


def make_scene(kind: str, batch: int, context: int, page_size: int, dtype, device, seed: int,
               num_queries: int = 1, group: int = 8):
    """(q, k_cache, v_cache, meta, kv_bytes) for a decode batch; see the module docstring."""
    import torch
    from kernel_cases import cascade_metadata

    g = torch.Generator().manual_seed(seed)
    if kind == "plain":
        groups = [(0, [context - num_queries]) for _ in range(batch)]
        unique_tokens = batch * context
    else:
        members = min(group, batch)
        assert batch % members == 0, "grpo scenes need whole groups"
        prefix_pages = context // 2 // page_size
        suffix = context - prefix_pages * page_size
        groups = [(prefix_pages, [suffix - num_queries] * members) for _ in range(batch // members)]
        unique_tokens = batch // members * prefix_pages * page_size + batch * suffix
    num_pages = sum(p + len(ms) * -(-(ms[0] + num_queries) // page_size) for p, ms in groups) + 1
    meta = cascade_metadata(groups, page_size, num_pages, g,
                            num_queries=[[num_queries] * len(ms) for _, ms in groups], device=str(device))
    k_cache, v_cache = make_pool(num_pages, page_size, dtype, device, seed)
    q = torch.randn(meta.num_tokens, QWEN_05B["num_heads"], QWEN_05B["head_dim"], generator=g).to(device, dtype)
    kv_bytes = 2 * unique_tokens * QWEN_05B["num_kv_heads"] * QWEN_05B["head_dim"] * k_cache.element_size()
    return q, k_cache, v_cache, meta, kv_bytes


# -- checks ------------------------------------------------------------------------------------
TOLERANCES = {"float32": (1e-4, 1e-4), "bfloat16": (1e-2, 2e-2)}   # (atol, rtol) vs the reference


def compare(name: str, dtype_name: str, got, want) -> dict:
    import torch

    atol, rtol = TOLERANCES[dtype_name]
    got, want = got.float(), want.float()
    err = (got - want).abs()
    bad = int((err > atol + rtol * want.abs()).sum()) + int((~torch.isfinite(got)).sum())
    return {"name": name, "dtype": dtype_name, "max_abs_err": float(err.max()), "atol": atol, "rtol": rtol,
            "bad_elements": bad, "ok": bad == 0}


def run_checks(device, tiny: bool) -> list[dict]:
    import torch
    from kernel_cases import plain_metadata
    from rollout.attention import cascade_decode_attention
    from rollout.kernels import triton_cascade_decode_attention, triton_paged_decode_attention, triton_store_kv

    page_size = 16
    context = 80 if tiny else 2048
    batch = 4 if tiny else 64
    results = []
    for dtype_name in ("float32", "bfloat16"):
        dtype = getattr(torch, dtype_name)
        # KV store: a prefill-sized batch of new tokens into random slots of a random pool.
        k_cache, v_cache = make_pool(64 if tiny else 4096, page_size, dtype, device, seed=1)
        num_new = 24 if tiny else 4096
        slots = torch.randperm(k_cache.shape[1], device=device)[:num_new]
        k = torch.randn(num_new, *k_cache.shape[::2], device=device).to(dtype)
        v = torch.randn(num_new, *k_cache.shape[::2], device=device).to(dtype)
        want_k, want_v = k_cache.clone(), v_cache.clone()
        want_k.index_copy_(1, slots, k.transpose(0, 1))
        want_v.index_copy_(1, slots, v.transpose(0, 1))
        triton_store_kv(k, v, k_cache, v_cache, slots)
        exact = torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v)
        results.append({"name": "kv_store", "dtype": dtype_name, "tokens": num_new, "exact": exact, "ok": exact})

        # Plain paged decode: lengths spread over (0, context].
        q, k_cache, v_cache, meta, _ = make_scene("plain", batch, context, page_size, dtype, device, seed=2)
        lengths = torch.randint(1, context + 1, (batch,), generator=torch.Generator().manual_seed(3)).tolist()
        ref_meta = plain_metadata(meta.suffix_pages, lengths, page_size)
        got = triton_paged_decode_attention(q, k_cache, v_cache, meta.suffix_pages,
                                            torch.tensor(lengths, device=device), page_size)
        want = cascade_decode_attention(q, k_cache, v_cache, ref_meta, page_size)
        results.append(compare("paged_decode", dtype_name, got, want))

        # Cascade, default split plan and forced small chunks (many splits); one query per
        # sequence, then 4 (speculative verification, causal among the step's queries).
        for num_queries in (1, 4):
            q, k_cache, v_cache, meta, _ = make_scene("grpo", batch, context, page_size, dtype, device, seed=4,
                                                      num_queries=num_queries, group=min(8, batch))
            want = cascade_decode_attention(q, k_cache, v_cache, meta, page_size)
            for chunk in (None, 64):
                got = triton_cascade_decode_attention(q, k_cache, v_cache, meta, page_size, chunk_tokens=chunk)
                name = f"cascade_decode_q{num_queries}" + ("_chunk64" if chunk else "")
                results.append(compare(name, dtype_name, got, want))
    return results


# -- timings -----------------------------------------------------------------------------------
def time_ms(fn, device, reps: int) -> float:
    """Median time of fn() in ms; on CUDA with events, L2 flushed (a 256 MB write) before each call."""
    import torch

    if device.type != "cuda":   # dry run: the interpreter's time means nothing, one call shows it runs
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3
    fn()   # warm-up: Triton compiles on first call
    flush = torch.empty(256 * 1024 * 1024, dtype=torch.int8, device=device)
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


def run_timings(device, tiny: bool, context: int | None, peak_gbps: float | None) -> list[dict]:
    import torch
    from rollout.attention import cascade_decode_attention
    from rollout.kernels import cascade_plan, split_k_decode_attention

    page_size = 16
    context = context or (32 if tiny else 4096)
    batches = (1, 2, 4) if tiny else (1, 8, 64)
    rows = []
    for kind in ("plain", "grpo"):
        for batch in batches:
            if kind == "grpo" and batch == 1:
                continue
            q, k_cache, v_cache, meta, kv_bytes = make_scene(kind, batch, context, page_size, torch.bfloat16,
                                                             device, seed=10 + batch, group=min(8, batch))
            phases, queries = cascade_plan(meta)   # built once per step in the engine, not per layer
            triton_ms = time_ms(lambda: split_k_decode_attention(q, k_cache, v_cache, page_size, phases, queries),
                                device, reps=30)
            torch_ms = time_ms(lambda: cascade_decode_attention(q, k_cache, v_cache, meta, page_size), device,
                               reps=10)
            triton_gbps = kv_bytes / (triton_ms * 1e-3) / 1e9
            rows.append({
                "kind": kind, "batch": batch, "context": context, "dtype": "bfloat16", "page_size": page_size,
                **QWEN_05B, "kv_bytes": kv_bytes,
                "triton_ms": round(triton_ms, 4), "torch_ms": round(torch_ms, 4),
                "speedup_vs_torch": round(torch_ms / triton_ms, 2),
                "triton_gbps": round(triton_gbps, 1),
                "torch_gbps": round(kv_bytes / (torch_ms * 1e-3) / 1e9, 1),
                "triton_frac_of_peak": round(triton_gbps / peak_gbps, 3) if peak_gbps else None,
            })
    return rows


if __name__ == "__main__":
    sys.exit(main())

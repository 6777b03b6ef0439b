"""KV cache capacity and decode throughput by KV storage dtype: fp8_e4m3 vs bfloat16 vs float32.

    python benchmarks/kv_capacity.py --save          # budget 1 GiB, Qwen2.5-0.5B's KV shape
    python benchmarks/kv_capacity.py --quick         # smaller decode run (dry runs)

Capacity, from pools really allocated (bytes of their K/V tensors, not a formula): KV tokens
per GiB, and how many sequences of `--seq-len` tokens fit at once in a `--budget-gib` pool, for
a model of `--layers` layers, `--kv-heads` KV heads of `--head-dim` (default: Qwen2.5-0.5B).
Decode throughput on this machine's device: greedy decode tokens / s of one engine over a
random tiny Qwen2 checkpoint in bfloat16, KV stored as bfloat16 vs as fp8_e4m3 (the FP8 path
stores with a quantize and reads with a dequantize; on CPU nothing runs in FP8 arithmetic, so
expect it no faster there). Prints one JSON object; `main(argv)` returns it.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks.run_record import RunRecord, add_output_args  # noqa: E402

GIB = 1 << 30
STORAGE = {"fp8_e4m3": torch.float8_e4m3fn, "bfloat16": torch.bfloat16, "float32": torch.float32}


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--budget-gib", type=float, default=1.0)
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--seq-len", type=int, default=4096, help="tokens per sequence (capacity)")
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--quick", action="store_true", help="4 prompts, 16 tokens")
    add_output_args(ap)
    return ap.parse_args(argv)


def capacity(args) -> dict:
    """Per storage dtype: a pool sized to the budget, allocated, its K/V bytes counted."""
    from rollout.kv_pool import KVPool

    out = {}
    for name, dtype in STORAGE.items():
        per_token = KVPool.bytes_per_token(args.layers, args.kv_heads, args.head_dim, dtype)
        pages = int(args.budget_gib * GIB) // per_token // args.page_size
        pool = KVPool(
            num_layers=args.layers,
            num_pages=pages,
            page_size=args.page_size,
            num_kv_heads=args.kv_heads,
            head_dim=args.head_dim,
            dtype=torch.bfloat16 if name == "fp8_e4m3" else dtype,
            storage_dtype=dtype,
            device=torch.device(args.device),
        )
        held = sum(t.numel() * t.element_size() for t in (pool.k, pool.v))
        pages_per_seq = -(-args.seq_len // args.page_size)
        out[name] = {
            "bytes_per_token": held / pool.num_slots,
            "kv_tokens_per_gib": pool.num_slots * GIB / held,
            "max_concurrent_sequences": pool.num_pages // pages_per_seq,
        }
        pool.free_memory()
    for name in out:
        out[name]["tokens_per_gib_vs_bf16"] = (
            out[name]["kv_tokens_per_gib"] / out["bfloat16"]["kv_tokens_per_gib"]
        )
    return out


def decode_throughput(args) -> dict:
    from rollout import Engine, EngineConfig, SamplingParams
    from rollout.random_checkpoint import TINY_QWEN2, write_random_checkpoint

    prompts, tokens = (4, 16) if args.quick else (16, 64)
    g = torch.Generator().manual_seed(0)
    batch = [torch.randint(0, 1000, (24,), generator=g).tolist() for _ in range(prompts)]
    params = SamplingParams(temperature=0.0, max_new_tokens=tokens, ignore_eos=True)
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = str(Path(tmp) / "model")
        write_random_checkpoint(model_dir, TINY_QWEN2, seed=0, std=0.1)
        for kv in ("auto", "fp8_e4m3"):
            engine = Engine(
                EngineConfig(
                    model_path=model_dir,
                    device=args.device,
                    dtype="bfloat16",
                    kv_cache_dtype=kv,
                    kv_cache_tokens=prompts * (24 + tokens) + 64,
                )
            )
            engine.generate(batch[:1], dataclasses.replace(params, max_new_tokens=2))  # warm
            start = time.perf_counter()
            engine.generate(batch, params)
            seconds = time.perf_counter() - start
            out["bfloat16" if kv == "auto" else kv] = {
                "decode_tokens_per_s": prompts * tokens / seconds,
                "kv_fp8_clipped_share": engine.stats()["kv_fp8_clipped_share"],
            }
    out["fp8_vs_bf16"] = (
        out["fp8_e4m3"]["decode_tokens_per_s"] / out["bfloat16"]["decode_tokens_per_s"]
    )
    return out


def main(argv=None) -> dict:
    record = RunRecord.start("kv_capacity", argv)
    args = parse_args(argv)
    result = {
        "shape": {
            "layers": args.layers,
            "kv_heads": args.kv_heads,
            "head_dim": args.head_dim,
            "budget_gib": args.budget_gib,
            "seq_len": args.seq_len,
        },
        "capacity": capacity(args),
        "decode": {"device": args.device, **decode_throughput(args)},
    }
    print(json.dumps(result, indent=2))
    record.finish(result, args)
    return result


if __name__ == "__main__":
    main()

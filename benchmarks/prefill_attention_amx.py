"""Paired A/B of the C prefill-attention kernel's bfloat16 path (rollout/native/
prefill_attention.c): its AMX tile build (the engine's on a CPU with AMX-BF16) against the same
source built without AMX (-mno-amx-*: the AVX-512 BF16 path, what main runs), on the engine's
prefill shape.

The shape: `--chunks` prompts of `--prompt-len` fresh tokens each (one prefill call of a layer),
8 query heads over 2 KV heads, head dim 32 (the vocab-512 model of rollout_throughput.py), and
the same at head dims 64 and 128 (`--head-dims`); q, k and v read in place from a fused q/k/v
projection output, as the engine passes them. Both builds are loaded in one process and called
alternately (A/B, then B/A) on the same inputs; the figure per head dim is the median of the
per-pair time ratios AVX-512 / AMX (> 1: AMX is faster). The outputs' largest difference is
reported too (the AMX path rounds the probabilities to bfloat16 before P V).

    flock /tmp/miles_cpu.lock .venv/bin/python benchmarks/prefill_attention_amx.py

Prints one JSON object.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.run_record import RunRecord, add_output_args  # noqa: E402
from rollout import native  # noqa: E402


def _inputs(chunks: int, length: int, heads: int, kv_heads: int, head_dim: int):
    g = torch.Generator().manual_seed(head_dim)
    fused = torch.randn(chunks * length, heads + 2 * kv_heads, head_dim, generator=g)
    q, k, v = fused.bfloat16().split([heads, kv_heads, kv_heads], dim=1)
    q, k, v = (x.unflatten(0, (chunks, length)) for x in (q, k, v))
    return q, k.transpose(1, 2), v.transpose(1, 2)


def main(argv=None) -> dict:
    record = RunRecord.start("prefill_attention_amx", argv)
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--chunks", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--head-dims", default="32,64,128")
    ap.add_argument("--pairs", type=int, default=20)
    ap.add_argument("--threads", type=int, default=2)
    add_output_args(ap)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    libs = {"amx": native.prefill(), "avx512": native.prefill.build(native.NO_AMX_FLAGS)}
    if not libs["amx"].prefill_attention_has_amx():
        raise SystemExit("this CPU / OS gives no AMX tiles: nothing to compare")
    assert not libs["avx512"].prefill_attention_has_amx()
    cases = {}
    for head_dim in (int(x) for x in args.head_dims.split(",")):
        q, k, v = _inputs(args.chunks, args.prompt_len, 8, 2, head_dim)
        outs = {name: torch.empty(q.shape, dtype=q.dtype) for name in libs}
        for name in libs:  # warm-up
            native.prefill_attention(libs[name], q, k, v, outs[name])
        seconds = {name: [] for name in libs}
        for p in range(args.pairs):
            for name in ("avx512", "amx") if p % 2 == 0 else ("amx", "avx512"):
                t0 = time.perf_counter()
                native.prefill_attention(libs[name], q, k, v, outs[name])
                seconds[name].append(time.perf_counter() - t0)
        ratios = [a / b for a, b in zip(seconds["avx512"], seconds["amx"])]
        cases[f"head_dim_{head_dim}"] = dict(
            avx512_ms_median=1e3 * statistics.median(seconds["avx512"]),
            amx_ms_median=1e3 * statistics.median(seconds["amx"]),
            speedup_median=statistics.median(ratios),
            max_abs_difference=(outs["amx"].float() - outs["avx512"].float()).abs().max().item(),
        )
    result = dict(
        shape=dict(chunks=args.chunks, prompt_len=args.prompt_len, heads=8, kv_heads=2),
        threads=args.threads,
        cases=cases,
        load_average_after=os.getloadavg(),
    )
    record.finish(result, args)
    return result


if __name__ == "__main__":
    with contextlib.redirect_stdout(sys.stderr):
        out = main()
    json.dump(out, sys.stdout, indent=2)
    sys.stdout.write("\n")

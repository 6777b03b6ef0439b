"""Paired A/B of one decode layer-step's element-wise calls: the checked wrappers as the model
pieces called them before (`native.rms_norm` twice, a torch residual add, `native.rotary_`,
`native.silu_mul` on the chunked gate/up output, `native.scatter_rows_` for K and for V) against
the engine's thin calls now (`rms_norm_unchecked`, `add_rms_norm_unchecked_` folding the add into
the second norm in bfloat16, `rotary_unchecked_`, `silu_mul_halves_unchecked`, one
`scatter_kv_rows_` for K and V). Both in this tree, the same process, alternating round by
round; the K/V rows go to scattered pages of a pool-sized buffer and a buffer is swept between
steps, as in the engine. Prints one JSON object (per-step microseconds and the paired median
ratio old / new per cell).

    .venv/bin/python benchmarks/pointwise_calls.py --rows 16 64 256
"""

from __future__ import annotations

import argparse
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


def old_step(lib, t: dict) -> None:
    """The calls of `rollout.native.layers` before: checked wrappers, separate add and stores."""
    native.rms_norm(lib, t["x"], t["weight"], 1e-6)
    native.rotary_(lib, t["qk"], t["cos"], t["sin"], t["positions"])
    native.scatter_rows_(lib, t["pool_k"], t["slots"], t["k"])
    native.scatter_rows_(lib, t["pool_v"], t["slots"], t["v"])
    x = t["residual"] + t["o_out"]
    native.rms_norm(lib, x, t["weight"], 1e-6)
    native.silu_mul(lib, *t["gate_up"].chunk(2, dim=-1))


def new_step(lib, t: dict) -> None:
    """The same work through the thin calls (float32 keeps the add out: its GEMM folds it)."""
    native.rms_norm_unchecked(lib, t["x"], t["weight"], 1e-6)
    native.rotary_unchecked_(lib, t["qk"], t["cos"], t["sin"], t["positions"])
    native.scatter_kv_rows_(lib, t["pool_k"], t["pool_v"], t["slots"], t["k"], t["v"])
    if t["x"].dtype == torch.bfloat16:
        native.add_rms_norm_unchecked_(lib, t["o_out"], t["residual"], t["weight"], 1e-6)
    else:
        native.rms_norm_unchecked(lib, t["residual"] + t["o_out"], t["weight"], 1e-6)
    native.silu_mul_halves_unchecked(lib, t["gate_up"])


def tensors(args, dtype: torch.dtype, rows: int) -> dict:
    g = torch.Generator().manual_seed(rows)
    qkv = torch.randn(rows, args.heads + 2 * args.kv_heads, args.head_dim, generator=g)
    qkv = qkv.to(dtype)
    freqs = torch.outer(
        torch.arange(args.positions, dtype=torch.float32),
        1.0 / 10000.0 ** (torch.arange(0, args.head_dim, 2, dtype=torch.float32) / args.head_dim),
    )
    table = torch.cat((freqs, freqs), dim=-1)
    pages = args.pool_slots // args.page_size
    pool = torch.zeros(2, args.kv_heads, args.pool_slots, args.head_dim, dtype=dtype)
    h = args.heads
    return dict(
        x=torch.randn(rows, args.hidden_size, generator=g).to(dtype),
        residual=torch.randn(rows, args.hidden_size, generator=g).to(dtype),
        o_out=torch.randn(rows, args.hidden_size, generator=g).to(dtype),
        weight=torch.randn(args.hidden_size, generator=g).to(dtype),
        gate_up=torch.randn(rows, 2 * args.intermediate_size, generator=g).to(dtype),
        qk=qkv[:, : h + args.kv_heads],
        k=qkv[:, h : h + args.kv_heads],
        v=qkv[:, h + args.kv_heads :],
        cos=table.cos().contiguous(),
        sin=table.sin().contiguous(),
        positions=torch.randint(0, args.positions, (rows,), generator=g),
        # one slot in each of `rows` scattered pages: a decode step's new tokens
        slots=torch.randperm(pages, generator=g)[:rows] * args.page_size,
        pool_k=pool[0],
        pool_v=pool[1],
    )


def main(argv=None) -> dict:
    record = RunRecord.start("pointwise_calls", argv)
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=300)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rows", type=int, nargs="+", default=[16, 64, 256])
    ap.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"])
    ap.add_argument("--hidden-size", type=int, default=256)
    ap.add_argument("--intermediate-size", type=int, default=704)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=32)
    ap.add_argument("--positions", type=int, default=2048)
    ap.add_argument("--pool-slots", type=int, default=1 << 16)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--evict-mib", type=int, default=16)
    add_output_args(ap)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    lib = native.pointwise()
    assert lib is not None, "the element-wise kernels are not available here"
    evict = torch.zeros(args.evict_mib << 18)
    load_before = os.getloadavg()
    paths = {"old": old_step, "new": new_step}
    cells = []
    for dtype_name in args.dtypes:
        for rows in args.rows:
            t = tensors(args, getattr(torch, dtype_name), rows)
            for step in paths.values():  # warm-up
                for _ in range(5):
                    step(lib, t)
            seconds = {name: [] for name in paths}
            for r in range(args.rounds):
                for name in ("old", "new") if r % 2 == 0 else ("new", "old"):
                    evict.add_(1.0)
                    t0 = time.perf_counter()
                    paths[name](lib, t)
                    seconds[name].append(time.perf_counter() - t0)
            ratios = [o / n for o, n in zip(seconds["old"], seconds["new"])]
            cell = dict(
                dtype=dtype_name,
                rows=rows,
                old_us_median=round(statistics.median(seconds["old"]) * 1e6, 1),
                new_us_median=round(statistics.median(seconds["new"]) * 1e6, 1),
                speedup_median=round(statistics.median(ratios), 3),
            )
            print(cell, file=sys.stderr, flush=True)
            cells.append(cell)
    result = dict(
        threads=args.threads,
        shape=dict(
            hidden=args.hidden_size,
            intermediate=args.intermediate_size,
            heads=args.heads,
            kv_heads=args.kv_heads,
            head_dim=args.head_dim,
        ),
        cells=cells,
        load_average_before=load_before,
        load_average_after=os.getloadavg(),
    )
    record.finish(result, args)
    return result


if __name__ == "__main__":
    main()

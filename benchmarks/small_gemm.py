"""The small-batch linear kernel (`rollout.native.small_linear_unchecked`, as the engine calls
it) against torch's GEMM at the engine's decode shapes, alternating, with the weights cached or
evicted between layers.

One "step" is what a decode step of the benchmark model multiplies (default: hidden 256,
intermediate 704, 8 / 2 heads of 32, vocab 512, 4 layers): per layer the fused q/k/v projection,
o_proj + residual, gate_up, down_proj + residual, then the LM head; each layer's weights its own
tensors. `--evict` writes a buffer larger than the L2 caches after each layer (outside the timed
region), as the K/V pool's reads do in the engine, so each layer's weights come from memory.
The two paths take turns step by step; the figure per (dtype, M, cache) is the median of the
per-round time ratios torch / kernel (> 1: the kernel is faster). Where the kernel runs bfloat16
on AMX tiles, its no-AMX build (the AVX-512 path) takes turns as a third path, with the median
ratio no-AMX / AMX. `--baseline REV` adds the kernel as built from another commit's sources
(`rollout/native` at REV) as a further path, with the median ratio baseline / this tree.
Prints one JSON object.

    flock /tmp/miles_cpu.lock .venv/bin/python benchmarks/small_gemm.py --rounds 200
    flock /tmp/miles_cpu.lock .venv/bin/python benchmarks/small_gemm.py --baseline main \
        --dtypes bfloat16 --rows 16 64 128 256 --skip no_amx
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

import native_build

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.run_record import RunRecord, add_output_args  # noqa: E402
from rollout import native  # noqa: E402


def layer_weights(args, dtype) -> list[dict]:
    h, i, d = args.hidden_size, args.intermediate_size, args.head_dim
    qkv = (args.heads + 2 * args.kv_heads) * d

    def w(n, k):
        return (torch.randn(n, k) / k**0.5).to(dtype)

    layers = [
        dict(qkv=w(qkv, h), o=w(h, args.heads * d), gate_up=w(2 * i, h), down=w(h, i))
        for _ in range(args.layers)
    ]
    layers[-1]["head"] = w(args.vocab_size, h)
    return layers


def torch_step(layer: dict, x: torch.Tensor) -> None:
    """The reference: what `rollout.native.layers` ran before the kernel (addmm folds the
    residual in float32; bfloat16 adds it after the product's rounding)."""

    def add_linear(residual, inputs, weight):
        if x.dtype == torch.float32:
            return torch.addmm(residual, inputs, weight.t())
        return residual + F.linear(inputs, weight)

    F.linear(x, layer["qkv"])
    add_linear(x, x, layer["o"])
    up = F.linear(x, layer["gate_up"])
    add_linear(x, up[:, : layer["down"].shape[1]].contiguous(), layer["down"])
    if "head" in layer:
        F.linear(x, layer["head"])


def kernel_step(lib, layer: dict, x: torch.Tensor) -> None:
    native.small_linear_unchecked(lib, x, layer["qkv"], None, None)
    native.small_linear_unchecked(lib, x, layer["o"], None, x)
    up = native.small_linear_unchecked(lib, x, layer["gate_up"], None, None)
    down_in = up[:, : layer["down"].shape[1]].contiguous()
    native.small_linear_unchecked(lib, down_in, layer["down"], None, x)
    if "head" in layer:
        native.small_linear_unchecked(lib, x, layer["head"], None, None)


def baseline_kernel(rev: str, directory: Path):
    """small_gemm.c as it was at `rev` (with the headers it includes from there), built with the
    same flags as this tree's."""
    archive = subprocess.run(
        ["git", "-C", str(ROOT), "archive", rev, "rollout/native"],
        check=True,
        capture_output=True,
    ).stdout
    archive_path = directory / "native.tar"
    archive_path.write_bytes(archive)
    with tarfile.open(archive_path) as tar:
        tar.extractall(directory, filter="data")
    source = directory / "rollout" / "native" / "small_gemm.c"
    return native.declare_small_gemm(native_build.load(source, native.FLAGS))


def timed_step(step, layers, x, evict: torch.Tensor | None) -> float:
    total = 0.0
    for layer in layers:
        if evict is not None:
            evict.add_(1.0)
        t0 = time.perf_counter()
        step(layer, x)
        total += time.perf_counter() - t0
    return total


def main(argv=None) -> dict:
    record = RunRecord.start("small_gemm", argv)
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=200)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 4, 8, 16, 32, 64])
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    ap.add_argument("--hidden-size", type=int, default=256)
    ap.add_argument("--intermediate-size", type=int, default=704)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=32)
    ap.add_argument("--vocab-size", type=int, default=512)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--evict-mib", type=int, default=32)
    ap.add_argument("--baseline", help="git revision whose kernel runs as a further path")
    ap.add_argument(
        "--skip",
        nargs="*",
        default=[],
        choices=["no_amx"],
        help="paths to leave out (no_amx: the no-AMX build)",
    )
    add_output_args(ap)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    lib = native.small_gemm()
    assert lib is not None, "the small-batch linear kernel is not available here"
    no_amx = (
        native.small_gemm.build(native.NO_AMX_FLAGS)
        if lib.small_gemm_has_amx() and "no_amx" not in args.skip
        else None
    )
    baseline_dir = tempfile.TemporaryDirectory() if args.baseline else None
    baseline = baseline_kernel(args.baseline, Path(baseline_dir.name)) if args.baseline else None
    evict_buffer = torch.zeros(args.evict_mib << 18)
    load_before = os.getloadavg()
    cells = []
    for dtype_name in args.dtypes:
        dtype = getattr(torch, dtype_name)
        layers = layer_weights(args, dtype)
        for rows in args.rows:
            x = torch.randn(rows, args.hidden_size).to(dtype)
            for evicted in (False, True):
                evict = evict_buffer if evicted else None
                paths = {
                    "torch": torch_step,
                    "kernel": lambda layer, x: kernel_step(lib, layer, x),
                }
                if no_amx is not None and dtype == torch.bfloat16:
                    paths["no_amx"] = lambda layer, x: kernel_step(no_amx, layer, x)
                if baseline is not None:
                    paths["baseline"] = lambda layer, x: kernel_step(baseline, layer, x)
                for step in paths.values():  # warm-up
                    for _ in range(3):
                        timed_step(step, layers, x, evict)
                seconds = {name: [] for name in paths}
                for r in range(args.rounds):
                    order = list(paths) if r % 2 == 0 else list(paths)[::-1]
                    for name in order:
                        seconds[name].append(timed_step(paths[name], layers, x, evict))
                ratios = [t / k for t, k in zip(seconds["torch"], seconds["kernel"])]
                cell = dict(
                    dtype=dtype_name,
                    rows=rows,
                    weights="evicted" if evicted else "cached",
                    torch_us_median=round(statistics.median(seconds["torch"]) * 1e6, 1),
                    kernel_us_median=round(statistics.median(seconds["kernel"]) * 1e6, 1),
                    speedup_median=round(statistics.median(ratios), 3),
                )
                if "no_amx" in paths:
                    cell["no_amx_us_median"] = round(statistics.median(seconds["no_amx"]) * 1e6, 1)
                    cell["amx_speedup_median"] = round(
                        statistics.median(
                            [n / k for n, k in zip(seconds["no_amx"], seconds["kernel"])]
                        ),
                        3,
                    )
                if "baseline" in paths:
                    cell["baseline_us_median"] = round(
                        statistics.median(seconds["baseline"]) * 1e6, 1
                    )
                    cell["baseline_speedup_median"] = round(
                        statistics.median(
                            [b / k for b, k in zip(seconds["baseline"], seconds["kernel"])]
                        ),
                        3,
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
            vocab=args.vocab_size,
            layers=args.layers,
        ),
        evict_mib=args.evict_mib,
        baseline=args.baseline,
        cells=cells,
        load_average_before=load_before,
        load_average_after=os.getloadavg(),
    )
    record.finish(result, args)
    return result


if __name__ == "__main__":
    import contextlib
    import json

    with contextlib.redirect_stdout(sys.stderr):  # libraries' log lines: stdout is the JSON
        out = main()
    json.dump(out, sys.stdout, indent=2)
    sys.stdout.write("\n")

"""Paired A/B of the C decode-attention kernel (rollout/native/cascade_decode.c) against another
version of its source, on the engine's GRPO decode shape.

The shape: D = 256 sequences = 32 groups x 8 members (member m of group g is sequence g * 8 + m;
`--groups` changes the number of groups), 2 KV heads x 4 query heads, head dim 32, a 128-key
prefix per group (`--prefix-len`; [Hkv, G, Lp, Dh], as the lanes keep it), each sequence's
suffix read in place from lanes [Hkv, lanes, capacity, Dh] (`--suffix-lens` wide; each sequence
sees all but 0-15 keys of its last page), q read in place from a fused q/k/v projection row.
As in the engine (4 layers, big GEMMs between calls), calls cycle through 4 independent input
sets and, with --cold (default), a 48 MiB buffer is written before each call to evict the
caches. K and V are float32, or with `--dtype bfloat16` bfloat16 (and q of bfloat16 values,
as a bfloat16 model's, so that the kernel takes its bfloat16 dot path).

Both builds are loaded in one process and called alternately (old/new, then new/old) on the
same inputs; the figure is the median of the per-pair time ratios old / new, robust to a noisy
machine. Outputs are compared too (max |old - new|: float32 rounding only).

    python benchmarks/decode_attention_kernel.py --baseline HEAD~1
    python benchmarks/decode_attention_kernel.py --baseline /tmp/old_cascade_decode.c --warm
    python benchmarks/decode_attention_kernel.py --baseline main --groups 16 --prefix-len 512

Prints one JSON object.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import math
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import native_build  # noqa: E402
from benchmarks.run_record import RunRecord, add_output_args  # noqa: E402
from rollout import native  # noqa: E402

SOURCE = ROOT / "rollout" / "native" / "cascade_decode.c"


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--baseline",
        required=True,
        help="the old kernel: a path to a cascade_decode.c, or a git revision of this repository",
    )
    ap.add_argument("--pairs", type=int, default=60, help="timed old/new pairs per setting")
    ap.add_argument("--threads", type=int, nargs="+", default=[2, 1])
    ap.add_argument("--suffix-lens", type=int, nargs="+", default=[32, 64, 128])
    ap.add_argument("--warm", action="store_true", help="no cache eviction between calls")
    ap.add_argument("--groups", type=int, default=32, help="groups of 8 sequences")
    ap.add_argument("--prefix-len", type=int, default=128, help="keys of each group's prefix")
    ap.add_argument(
        "--dtype",
        default="float32",
        choices=["float32", "bfloat16"],
        help="K / V element type; bfloat16 also rounds q to bfloat16 values (a bfloat16 model's)",
    )
    add_output_args(ap)
    return ap.parse_args(argv)


def baseline_library(spec: str, workdir: Path) -> ctypes.CDLL:
    """The baseline source built beside a copy of its header (native_build keys the cache by
    both), with the engine's flags."""
    path = Path(spec)
    if path.is_file():
        text = path.read_text()
    else:
        rev = f"{spec}:rollout/native/cascade_decode.c"
        text = subprocess.run(
            ["git", "-C", str(ROOT), "show", rev], capture_output=True, text=True, check=True
        ).stdout
    (workdir / "cascade_decode.c").write_text(text)
    for header in ("vector_math.h", "amx_tiles.h"):
        shutil.copy(SOURCE.with_name(header), workdir / header)
    return native.declare_attention(native_build.load(workdir / "cascade_decode.c", native.FLAGS))


def input_set(
    g: torch.Generator,
    suffix_len: int,
    threads: int,
    groups: int = 32,
    prefix_len: int = 128,
    dtype: torch.dtype = torch.float32,
) -> tuple[list, tuple, torch.Tensor]:
    """(tensors to keep alive, the kernel's arguments, its output tensor) for one layer."""
    seqs, kv_heads, rows, head_dim = groups * 8, 2, 4, 32
    capacity = max(256, suffix_len + 64)
    fused = torch.randn(seqs, kv_heads * rows + 2 * kv_heads, head_dim, generator=g)
    fused = fused.to(dtype).float()  # a bfloat16 model's q: bfloat16 values, widened
    q = fused[:, : kv_heads * rows].unflatten(1, (kv_heads, rows))
    lanes = [
        torch.randn(kv_heads, seqs, capacity, head_dim, generator=g).to(dtype) for _ in range(2)
    ]
    sk, sv = (t[:, :, :suffix_len] for t in lanes)
    visible = suffix_len - torch.randint(0, 16, (seqs,), generator=g)
    sbias = torch.zeros(seqs, 1, suffix_len)
    sbias.masked_fill_(torch.arange(suffix_len) >= visible[:, None, None], float("-inf"))
    pk, pv = (
        torch.randn(kv_heads, groups, prefix_len, head_dim, generator=g).to(dtype) for _ in range(2)
    )
    pbias = torch.zeros(groups, prefix_len)
    group_of = torch.arange(seqs) // (seqs // groups)
    out = torch.empty(seqs, kv_heads, rows, head_dim)
    args = (
        seqs, kv_heads, rows, head_dim, rows, q.data_ptr(), q.stride(0),
        sk.data_ptr(), sv.data_ptr(), sk.stride(0), sk.stride(1), suffix_len, sbias.data_ptr(),
        pk.data_ptr(), pv.data_ptr(), pk.stride(0), pk.stride(1), prefix_len, pbias.data_ptr(),
        group_of.data_ptr(), groups, 1 / math.sqrt(head_dim), out.data_ptr(), threads,
    )  # fmt: skip
    return [fused, *lanes, sbias, pk, pv, pbias, group_of, out], args, out


def main(argv=None) -> dict:
    record = RunRecord.start("decode_attention_kernel", argv)
    args = parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        libs = {"old": baseline_library(args.baseline, Path(tmp)), "new": native.attention()}
    assert libs["new"] is not None, "the kernel could not be built here"
    evict = None if args.warm else torch.empty(48 << 18)  # 48 MiB of float32
    result = {
        "baseline": args.baseline,
        "cold": not args.warm,
        "pairs": args.pairs,
        "groups": args.groups,
        "prefix_len": args.prefix_len,
        "dtype": args.dtype,
        "runs": [],
    }
    dtype = getattr(torch, args.dtype)
    entry = "cascade_decode_bf16" if dtype == torch.bfloat16 else "cascade_decode_f32"
    before = torch.get_num_threads()
    try:
        for suffix_len in args.suffix_lens:
            for threads in args.threads:
                torch.set_num_threads(threads)
                g = torch.Generator().manual_seed(suffix_len)
                sets = [
                    input_set(g, suffix_len, threads, args.groups, args.prefix_len, dtype)
                    for _ in range(4)
                ]
                kernel = {name: getattr(lib, entry) for name, lib in libs.items()}
                outs = {}
                for name in libs:
                    assert kernel[name](*sets[0][1]) == 0
                    outs[name] = sets[0][2].clone()
                times = {"old": [], "new": []}
                for i in range(args.pairs):
                    call_args = sets[i % len(sets)][1]
                    for name in ("old", "new") if i % 2 == 0 else ("new", "old"):
                        if evict is not None:
                            evict.fill_(i)
                        start = time.perf_counter()
                        kernel[name](*call_args)
                        times[name].append(time.perf_counter() - start)
                ratios = [a / b for a, b in zip(times["old"], times["new"])]
                result["runs"].append(
                    {
                        "suffix_len": suffix_len,
                        "threads": threads,
                        "old_ms": round(statistics.median(times["old"]) * 1e3, 4),
                        "new_ms": round(statistics.median(times["new"]) * 1e3, 4),
                        "speedup": round(statistics.median(ratios), 4),
                        "max_abs_diff": (outs["old"] - outs["new"]).abs().max().item(),
                    }
                )
    finally:
        torch.set_num_threads(before)
    record.finish(result, args)
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()

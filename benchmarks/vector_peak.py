"""This core's sustained rate of 512-bit FMAs (`vfmadd231ps`) and bfloat16 dot products
(`vdpbf16ps`, two products a lane), per TSC cycle, against the number of independent
accumulator chains: the ceiling a register-blocked kernel (rollout/native/cascade_decode.c)
can reach here, and how many chains it needs to reach it. One thread; a chain of length 1
gives the instruction's latency in TSC cycles (its inverse).

A small C probe is compiled with the engine's flags (-O3 -march=native) into a temporary
directory and run `--repeats` times per setting; the figure per setting is the best run (the
box is shared: the others are the other tenants). Needs a C compiler and AVX-512 (BF16 for the
dot rows; they are left out where the CPU lacks it).

    python benchmarks/vector_peak.py --out /tmp/vector_peak.json

Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.run_record import RunRecord, add_output_args  # noqa: E402

PROBE = r"""
#include <immintrin.h>
#include <stdio.h>
#include <x86intrin.h>
/* CHAINS (<= 32) independent accumulators, each updated ITERS times by OP. Each accumulator is
   a variable of its own (a0, a1, ...), not an element of an array: an empty asm on an array
   element ("+v"(a[i])) made gcc keep the array in memory, so every update was a load, the op
   and a store (a chain through memory, not the op's own latency and throughput). The empty asm
   on a plain variable only pins it in a register and keeps every update in the loop. */
#define EACH(X) X(0) X(1) X(2) X(3) X(4) X(5) X(6) X(7) X(8) X(9) X(10) X(11) X(12) X(13) \
  X(14) X(15) X(16) X(17) X(18) X(19) X(20) X(21) X(22) X(23) X(24) X(25) X(26) X(27) X(28) \
  X(29) X(30) X(31)
#define DECLARE(i) __m512 a##i = _mm512_set1_ps(0.001f * i);
#define UPDATE(i) if (i < CHAINS) { a##i = OP(a##i); __asm__("" : "+v"(a##i)); }
#define SUM(i) if (i < CHAINS) sink += _mm512_reduce_add_ps(a##i);
int main(void) {
  EACH(DECLARE)
#if DOT
  const __m512bh b = (__m512bh)_mm512_set1_epi32(0x3f803f80);
  const __m512bh c = (__m512bh)_mm512_set1_epi32(0x3a803a80);
#define OP(x) _mm512_dpbf16_ps(x, b, c)
#else
  const __m512 b = _mm512_set1_ps(0.999f), c = _mm512_set1_ps(0.001f);
#define OP(x) _mm512_fmadd_ps(x, b, c)
#endif
  const long iters = ITERS;
  const unsigned long long t0 = __rdtsc();
  for (long n = 0; n < iters; n++) {
    EACH(UPDATE)
  }
  const unsigned long long t1 = __rdtsc();
  float sink = 0.f;
  EACH(SUM)
  printf("%.6f %g\n", (double)CHAINS * iters / (double)(t1 - t0), sink);
  return 0;
}
"""


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--chains", type=int, nargs="+", default=[1, 4, 8, 12, 16, 24], help="<= 32")
    ap.add_argument("--iters", type=int, default=20_000_000, help="updates of each chain")
    ap.add_argument("--repeats", type=int, default=3)
    add_output_args(ap)
    return ap.parse_args(argv)


def main(argv=None) -> dict:
    record = RunRecord.start("vector_peak", argv)
    args = parse_args(argv)
    has_bf16 = "avx512_bf16" in Path("/proc/cpuinfo").read_text()
    result = {"iters": args.iters, "repeats": args.repeats, "rows": []}
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "probe.c"
        src.write_text(PROBE)
        for op in ["fma"] + (["dpbf16"] if has_bf16 else []):
            for chains in args.chains:
                exe = Path(tmp) / f"{op}{chains}"
                subprocess.run(
                    ["cc", "-O3", "-march=native", f"-DCHAINS={chains}", f"-DITERS={args.iters}",
                     f"-DDOT={int(op == 'dpbf16')}", str(src), "-o", str(exe)],
                    check=True,
                )  # fmt: skip
                runs = [
                    float(subprocess.run([str(exe)], capture_output=True, text=True, check=True)
                          .stdout.split()[0])
                    for _ in range(args.repeats)
                ]  # fmt: skip
                result["rows"].append(
                    {"op": op, "chains": chains, "per_tsc_cycle": round(max(runs), 3)}
                )
    record.finish(result, args)
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()

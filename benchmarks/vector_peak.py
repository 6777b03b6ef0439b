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
/* CHAINS independent accumulators, each updated ITERS times by OP; the empty asm keeps every
   accumulator in a register and every update in the loop. */
int main(void) {
  __m512 a[CHAINS];
  for (int i = 0; i < CHAINS; i++) a[i] = _mm512_set1_ps(0.001f * i);
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
    _Pragma("GCC unroll 32") for (int i = 0; i < CHAINS; i++) {
      a[i] = OP(a[i]);
      __asm__("" : "+v"(a[i]));
    }
  }
  const unsigned long long t1 = __rdtsc();
  float sink = 0.f;
  for (int i = 0; i < CHAINS; i++) sink += _mm512_reduce_add_ps(a[i]);
  printf("%.6f %g\n", (double)CHAINS * iters / (double)(t1 - t0), sink);
  return 0;
}
"""


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--chains", type=int, nargs="+", default=[1, 4, 8, 12, 16])
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

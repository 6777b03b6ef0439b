"""`python -m benchmarks.gpu_suite [--dry-run] [--sections ...]`; see benchmarks/gpu_suite.sh."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from benchmarks.gpu_suite import __doc__ as SUITE_DOC
from benchmarks.gpu_suite.harness import REPO, SuiteOptions, run_suite
from benchmarks.gpu_suite.sections import NOT_COVERED, SECTIONS

GPU_CAP_S = 290.0  # gpu_suite.sh's `timeout 300` is the backstop
DRY_RUN_CAP_S = 900.0


def parse_args(argv=None) -> argparse.Namespace:
    names = [s.name for s in SECTIONS]
    p = argparse.ArgumentParser(
        prog="benchmarks/gpu_suite.sh",
        description=SUITE_DOC,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--dry-run",
        action="store_true",
        help="on CPU: the sections that have a CPU form at tiny sizes (Triton interpreted), the"
        " others skipped",
    )
    p.add_argument("--sections", nargs="+", choices=names, default=names)
    p.add_argument(
        "--out",
        type=Path,
        default=Path(os.environ["OUT"]) if os.environ.get("OUT") else None,
        help="folder for gpu_suite.jsonl and gpu_suite.log (default: $OUT when set)",
    )
    p.add_argument(
        "--wheels",
        type=Path,
        default=REPO / ".gpu_wheels",
        help="carried wheels to install first (default: .gpu_wheels/, from download_wheels.sh)",
    )
    p.add_argument("--cap-s", type=float, default=None, help="the whole run's time cap")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    options = SuiteOptions(
        dry_run=args.dry_run,
        cap_s=args.cap_s or (DRY_RUN_CAP_S if args.dry_run else GPU_CAP_S),
        preflight_budget_s=60.0 if args.dry_run else 30.0,
        out_dir=args.out,
        wheel_dir=args.wheels,
        not_covered=NOT_COVERED,
    )
    chosen = [s for s in SECTIONS if s.name in args.sections]
    return run_suite(chosen, options)


if __name__ == "__main__":
    sys.exit(main())

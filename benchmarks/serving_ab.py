"""Our OpenAI server against itself at another commit, under vLLM's own load generator.

The serving run of `benchmarks/vs_vllm.py` (`vllm bench serve`: random prompts of 128 tokens,
128 out, EOS ignored, T = 1, 256 streamed completions at concurrency 64, float32, the tiny Qwen2
with its byte-level tokenizer), for our `python -m rollout.serving.server` only, from two source
trees: this checkout (B) and `--base` (A: a git ref of this repository, exported to a temporary
directory). The trees alternate round by round (the order swapped every round) on the same
pinned CPUs, so background load hits both alike. A server's imports come from its tree (it runs
with that tree as its working directory); both use this interpreter.

Prints one JSON object: per tree each round's output tokens/s, TTFT and TPOT p50 and failed
requests; the medians; `b_over_a` (median of the per-round output-throughput ratios; > 1: this
checkout faster); the load average before and after.

    .venv/bin/python benchmarks/serving_ab.py --base main --rounds 3
    .venv/bin/python benchmarks/serving_ab.py --base main --vllm-venv /path/.venv-vllm --quick
    .venv/bin/python benchmarks/serving_ab.py --dry-run          # the plan and commands only
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks import vllm_env  # noqa: E402
from benchmarks.run_record import RunRecord, add_output_args  # noqa: E402
from benchmarks.vs_vllm import (  # noqa: E402
    MODEL_NAME,
    bench_command,
    bench_server,
    build_model,
    choose_cpus,
    engine_env,
    free_port,
    pinned,
    server_command,
    server_cpu,
)

KEYS = ("output_throughput", "median_ttft_ms", "median_tpot_ms", "failed", "completed")


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", default="main", help="the git ref to compare this checkout with")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2, help="CPUs the server and client share")
    ap.add_argument("--serving-requests", type=int, default=256)
    ap.add_argument("--serving-concurrency", type=int, default=64)
    ap.add_argument("--serving-len", type=int, default=128, help="prompt and output tokens")
    ap.add_argument("--serving-dtype", default="float32", choices=("float32", "bfloat16"))
    ap.add_argument("--vllm-venv", type=Path, default=vllm_env.VENV)
    ap.add_argument("--quick", action="store_true", help="16 requests of 32 / 32, concurrency 8")
    ap.add_argument("--verbose", action="store_true", help="show the servers' logs")
    ap.add_argument("--dry-run", action="store_true", help="print the plan and commands only")
    add_output_args(ap)
    args = ap.parse_args(argv)
    if args.quick:
        args.serving_requests, args.serving_concurrency, args.serving_len = 16, 8, 32
    if args.rounds < 1:
        ap.error("--rounds must be at least 1")
    return args


def export(ref: str, directory: Path) -> None:
    """The tree of `ref` written to `directory` (tracked files only)."""
    archive = subprocess.run(
        ["git", "archive", "--format=tar", ref], cwd=ROOT, check=True, capture_output=True
    ).stdout
    subprocess.run(["tar", "-x", "-C", str(directory)], input=archive, check=True)


def serve_once(tree: Path, args, model_dir: Path, cpus: list[int], work: Path, name: str) -> dict:
    """One `vllm bench serve` run (pinned to the server's CPUs) against our server started from
    `tree`."""
    port = free_port()
    raw = bench_server(
        pinned(server_command("ours", args, model_dir, port), cpus),
        engine_env("ours", args, cpus),
        pinned(bench_command(args, model_dir, port, work, name), cpus),
        port,
        work / f"{name}.json",
        args.verbose,
        server_cwd=tree,
    )
    return {k: raw.get(k) for k in KEYS} | server_cpu(raw)


def commit_of(ref: str) -> str:
    """The commit `ref` names; one clear line if it names none."""
    proc = subprocess.run(
        ["git", "rev-parse", "--verify", "--quiet", f"{ref}^{{commit}}"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    if proc.returncode != 0:
        raise SystemExit(f"--base {ref!r}: not a commit of this repository; name a branch or hash")
    return proc.stdout.strip()


def plan(args, cpus: list[int]) -> dict:
    """What the run would do: the base commit, the server and client commands."""
    model_dir, port = Path("MODEL_DIR"), 0
    return {
        "base_commit": commit_of(args.base),
        "rounds": args.rounds,
        "order": ["ab" if r % 2 == 0 else "ba" for r in range(args.rounds)],
        "server_command": pinned(server_command("ours", args, model_dir, port), cpus),
        "bench_command": pinned(bench_command(args, model_dir, port, Path("WORK"), "a0"), cpus),
    }


def main(argv=None) -> dict:
    record = RunRecord.start("serving_ab", argv)
    args = parse_args(argv)
    cpus = choose_cpus(args.threads)
    if args.dry_run:
        return plan(args, cpus)
    vllm_env.ensure(args.vllm_venv)
    rounds: dict[str, list[dict]] = {"a": [], "b": []}
    result: dict = {
        "base": args.base,
        "base_commit": commit_of(args.base),
        "workload": {
            "requests": args.serving_requests,
            "concurrency": args.serving_concurrency,
            "input_len": args.serving_len,
            "output_len": args.serving_len,
            "dtype": args.serving_dtype,
            "client": "vllm bench serve --backend vllm (streamed /v1/completions)",
        },
        "pinned_cpus": cpus,
        "load_average_before": os.getloadavg(),
    }
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        model_dir = work / MODEL_NAME
        build_model(model_dir)
        base = work / "base"
        base.mkdir()
        export(args.base, base)
        trees = {"a": base, "b": ROOT}
        for r in range(args.rounds):
            for side in "ab" if r % 2 == 0 else "ba":
                out = serve_once(trees[side], args, model_dir, cpus, work, f"{side}{r}")
                rounds[side].append(out)
                print(f"round {r} {side}: {out}", file=sys.stderr)
    for side in ("a", "b"):
        result[side] = {
            "rounds": rounds[side],
            **{f"median_{k}": statistics.median(x[k] for x in rounds[side]) for k in KEYS[:3]},
            "failed": sum(x["failed"] for x in rounds[side]),
        }
    result["b_over_a"] = statistics.median(
        b["output_throughput"] / a["output_throughput"] for a, b in zip(rounds["a"], rounds["b"])
    )
    result["load_average_after"] = os.getloadavg()
    record.finish(result, args)
    return result


if __name__ == "__main__":
    with contextlib.redirect_stdout(sys.stderr):
        out = main()
    json.dump(out, sys.stdout, indent=2)
    sys.stdout.write("\n")

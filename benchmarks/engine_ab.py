"""Paired A/B of the whole engine: this tree against another commit, on the GRPO workload.

Two worker processes, one importing `rollout` from this tree and one from a temporary git
worktree of `--baseline`, each hold a warm engine on the same model (the vocab-512 / 8-head one
by default: 32 prompts x 8 samples x 128 new tokens, radix on, float32, 2 threads; `--dtype`
and `--no-prefix-cache` change the last three).
They take turns, one `generate()` each per round, alternating which goes first, so a noisy
machine slows both alike; the figure is the median of the per-round time ratios baseline / this
tree (> 1: this tree is faster). Prints one JSON object.

    .venv/bin/python benchmarks/engine_ab.py --baseline df8b1ce --rounds 12
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

from benchmarks.run_record import RunRecord, add_output_args  # noqa: E402

WORKER = r"""
import json, sys, time
tree, model_dir, threads = sys.argv[1], sys.argv[2], int(sys.argv[3])
sys.path.insert(0, tree)
import torch
torch.set_num_threads(threads)
import rollout
from rollout import Engine, EngineConfig, SamplingParams
assert rollout.__file__.startswith(tree), rollout.__file__
cfg = json.loads(sys.stdin.readline())
engine = Engine(EngineConfig(model_path=model_dir, device="cpu", dtype=cfg["dtype"],
                             kv_cache_tokens=cfg["kv_tokens"], seed=0,
                             enable_prefix_cache=cfg["prefix_cache"]))
params = SamplingParams(n=cfg["n"], temperature=1.0, max_new_tokens=cfg["new_tokens"],
                        ignore_eos=True)
def prompts(seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, cfg["vocab"], (cfg["prompts"], cfg["prompt_len"]), generator=g).tolist()
engine.generate(prompts(0), params)  # warm-up
print("ready", flush=True)
for line in sys.stdin:
    t0 = time.perf_counter()
    engine.generate(prompts(int(line)), params)
    print(time.perf_counter() - t0, flush=True)
"""


def main(argv=None) -> dict:
    record = RunRecord.start("engine_ab", argv)
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--baseline", required=True, help="git revision to compare against")
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--vocab-size", type=int, default=512)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument(
        "--no-prefix-cache", action="store_true", help="both engines without the radix cache"
    )
    add_output_args(ap)
    args = ap.parse_args(argv)
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import rollout_throughput

    shape = rollout_throughput.parse_args(
        ["--vocab-size", str(args.vocab_size), "--heads", str(args.heads)]
        + ["--kv-heads", str(args.kv_heads)]
        # the model's positions cover prompt + new tokens
        + ["--prompt-len", str(args.prompt_len), "--new-tokens", str(args.new_tokens)]
    )
    cfg = dict(
        vocab=args.vocab_size,
        prompts=args.prompts,
        prompt_len=args.prompt_len,
        n=args.n,
        new_tokens=args.new_tokens,
        dtype=args.dtype,
        prefix_cache=not args.no_prefix_cache,
        kv_tokens=args.prompts * args.n * (args.prompt_len + args.new_tokens) + 1024,
    )
    with tempfile.TemporaryDirectory() as tmp:
        model_dir, base_tree = Path(tmp) / "model", Path(tmp) / "baseline"
        rollout_throughput.build_model(shape, model_dir)
        subprocess.run(
            ["git", "-C", str(ROOT), "worktree", "add", "--detach", str(base_tree), args.baseline],
            check=True,
            capture_output=True,
        )
        try:
            trees = {"baseline": str(base_tree), "this": str(ROOT)}
            workers = {
                name: subprocess.Popen(
                    [sys.executable, "-c", WORKER, tree, str(model_dir), str(args.threads)],
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    text=True,
                    cwd=tmp,
                    env=dict(os.environ, PYTHONPATH=""),
                )
                for name, tree in trees.items()
            }
            for w in workers.values():
                w.stdin.write(json.dumps(cfg) + "\n")
                w.stdin.flush()
            for name, w in workers.items():
                if w.stdout.readline().strip() != "ready":
                    raise RuntimeError(f"the {name} worker failed to start")
            seconds = {name: [] for name in workers}
            for r in range(args.rounds):
                for name in ("baseline", "this") if r % 2 == 0 else ("this", "baseline"):
                    workers[name].stdin.write(f"{100 + r}\n")
                    workers[name].stdin.flush()
                    seconds[name].append(float(workers[name].stdout.readline()))
            for w in workers.values():
                w.stdin.close()
                w.wait()
        finally:
            subprocess.run(
                ["git", "-C", str(ROOT), "worktree", "remove", "--force", str(base_tree)],
                capture_output=True,
            )
    ratios = [b / t for b, t in zip(seconds["baseline"], seconds["this"])]
    result = dict(
        baseline=args.baseline,
        workload=cfg,
        threads=args.threads,
        baseline_s_median=statistics.median(seconds["baseline"]),
        this_s_median=statistics.median(seconds["this"]),
        speedup_median=statistics.median(ratios),
        speedup_per_round=[round(x, 4) for x in ratios],
        load_average_after=os.getloadavg(),
    )
    record.finish(result, args)
    return result


if __name__ == "__main__":
    with contextlib.redirect_stdout(sys.stderr):  # libraries' log lines: stdout is the JSON
        out = main()
    json.dump(out, sys.stdout, indent=2)
    sys.stdout.write("\n")

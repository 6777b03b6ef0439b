"""Does the default task learn as well with FP8 rollouts (plus the importance correction) as with
bf16 rollouts? Prints one JSON object.

The default recipe (`recipes/tiny_arith_grpo.yaml`, `--recipe` runs another) trained in bfloat16
(`model.dtype=bfloat16`) with truncated importance sampling (`algorithm.is_correction=tis`) in
every arm, run as a user runs it (`python -m miles_like.train`, one process a run), in arms that
differ only in the rollout engine:

* bf16: the engine holds the bf16 weights the trainer pushes;
* fp8: `rollout.quantization=fp8`: the linear layers' weights quantized to float8_e4m3 with
  128 x 128 block scales at every weight sync;
* fp8_kv (`--arms bf16 fp8 fp8_kv`): FP8 weights and `rollout.kv_cache_dtype=fp8_e4m3`.

For each seed (the recipe's `seed`: the base model's init, the warm start's data, the RL prompts
and their order, every sampling seed) the arms run one after another, their order rotating with
the seed; all runs share one cache directory, so a seed's warm start is built by its first run
and reused by the others (every arm starts RL from the same bf16 weights).

Learning signal: `rollout/reward_mean` (the arithmetic reward, so the success rate). Per run: its
mean over the first k steps and the last k, the gain (last - first), and `train/mismatch_kl`
(the k3 estimate of KL(engine || trainer) on the trained tokens) and `train/logprob_diff_max`,
averaged over the steps. Per arm: mean, standard deviation and standard error of the gain and
the mean mismatch KL. The margin is stated before the run as a fraction of the bf16 arm's mean
gain (`--margin-frac`, default 1/3, as the async parity study). Each FP8 arm against bf16:
the paired difference of the gains (a seed's arms share the base model, the warm start and the
prompts), its t-test and paired TOST at the margin, and the unpaired Welch test and TOST
(`benchmarks/async_learning.py`'s statistics).

    python benchmarks/fp8_parity.py [--seeds 0 1 2 --steps 300 --k 10 --arms bf16 fp8] [--save]
    python benchmarks/fp8_parity.py --quick     # smoke test: 2 seeds, 2 steps, short warm start
    (--output-dir DIR keeps every run's metrics.jsonl and summary in DIR/ARM_SEED and writes
    DIR/progress.json after every run; --resume reuses the runs finished there with the same
    overrides, e.g. to add seeds or an arm; --set KEY=VALUE, repeated, overrides the recipe in
    every arm)
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.async_learning import equivalence, paired, sync_learns, welch  # noqa: E402
from benchmarks.run_record import RunRecord, add_output_args  # noqa: E402

RECIPE = REPO / "recipes" / "tiny_arith_grpo.yaml"
COMMON = (
    "model.dtype=bfloat16",
    "algorithm.is_correction=tis",
    "checkpoint.every_steps=0",
    "tracking.wandb_project=null",
)
ARMS = {
    "bf16": (),
    "fp8": ("rollout.quantization=fp8",),
    "fp8_kv": ("rollout.quantization=fp8", "rollout.kv_cache_dtype=fp8_e4m3"),
}
# the smoke test checks the plumbing, not learning: a short warm start, small steps
QUICK = ("sft.steps=4", "rollout.prompts_per_step=8", "trainer.updates_per_rollout=2")


def run_once(
    recipe: Path, overrides: list[str], out: Path, cache: Path
) -> tuple[list[dict], float]:
    """One `python -m miles_like.train` run: its metrics rows and its wall time."""
    env = dict(os.environ, MILES_LIKE_CACHE=str(cache), WANDB_MODE="offline")
    start = time.perf_counter()
    subprocess.run(
        [
            sys.executable,
            "-m",
            "miles_like.train",
            str(recipe),
            *overrides,
            f"tracking.output_dir={out}",
        ],
        cwd=REPO,
        env=env,
        check=True,
        stdout=subprocess.DEVNULL,
    )
    wall = time.perf_counter() - start
    lines = (out / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines], wall


def summarize_run(rows: list[dict], wall: float, k: int) -> dict:
    reward = [row["rollout/reward_mean"] for row in rows]
    first, last = statistics.mean(reward[:k]), statistics.mean(reward[-k:])
    return {
        "steps": len(rows),
        "k": k,
        "reward_first_k": first,
        "reward_last_k": last,
        "gain": last - first,
        "mismatch_kl_mean": statistics.mean(row["train/mismatch_kl"] for row in rows),
        "mismatch_kl_max": max(row["train/mismatch_kl"] for row in rows),
        "logprob_diff_max_mean": statistics.mean(row["train/logprob_diff_max"] for row in rows),
        "run_wall_s": wall,
        "reward_per_step": [round(x, 4) for x in reward],
        "mismatch_kl_per_step": [row["train/mismatch_kl"] for row in rows],
    }


def finished_run(path: Path, overrides: list[str], k: int) -> dict | None:
    """`--resume`: the summary a finished run of these overrides left (a run is deterministic
    given its seed and overrides, so rerunning it would reproduce it), or None."""
    if not path.exists():
        return None
    run = json.loads(path.read_text())
    if run["overrides"] != overrides or run["k"] != k:
        return None
    return run


def summarize_arm(runs: list[dict]) -> dict:
    gains = [r["gain"] for r in runs]
    sd = statistics.stdev(gains) if len(gains) > 1 else None
    return {
        "seeds": [r["seed"] for r in runs],
        "gains": gains,
        "gain_mean": statistics.mean(gains),
        "gain_std": sd,
        "gain_se": sd / math.sqrt(len(gains)) if sd is not None else None,
        "reward_first_k_mean": statistics.mean(r["reward_first_k"] for r in runs),
        "reward_last_k_mean": statistics.mean(r["reward_last_k"] for r in runs),
        "mismatch_kl_mean": statistics.mean(r["mismatch_kl_mean"] for r in runs),
        "logprob_diff_max_mean": statistics.mean(r["logprob_diff_max_mean"] for r in runs),
        "run_wall_s_mean": statistics.mean(r["run_wall_s"] for r in runs),
    }


def main() -> None:
    record = RunRecord.start("fp8_parity")
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2], help="seeds, >= 2")
    ap.add_argument("--steps", type=int, default=300, help="RL steps per run")
    ap.add_argument("--k", type=int, default=10, help="steps in the first / last reward window")
    ap.add_argument("--arms", nargs="+", choices=list(ARMS), default=["bf16", "fp8"])
    ap.add_argument("--quick", action="store_true", help="smoke test: 2 seeds, 2 steps, k 1")
    ap.add_argument("--output-dir", type=Path, help="keep every run's outputs here")
    ap.add_argument(
        "--resume",
        action="store_true",
        help="with --output-dir: reuse the runs already finished there with the same overrides",
    )
    ap.add_argument("--recipe", type=Path, default=RECIPE, help="the recipe every arm runs")
    ap.add_argument(
        "--margin-frac",
        type=float,
        default=1 / 3,
        help="equivalence margin (TOST) as a fraction of the bf16 arm's mean gain",
    )
    ap.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="recipe override for every arm (repeatable)",
    )
    add_output_args(ap)
    args = ap.parse_args()
    if args.quick:
        args.seeds, args.steps, args.k = args.seeds[:2], 2, 1
    if len(args.seeds) < 2:
        ap.error("--seeds needs at least two seeds (a standard deviation and a t-test)")
    if "bf16" not in args.arms:
        ap.error("--arms must include bf16, the reference arm")
    if not 1 <= args.k <= args.steps // 2:
        ap.error(f"--k must be between 1 and --steps / 2 = {args.steps // 2}")
    if args.resume and not args.output_dir:
        ap.error("--resume needs --output-dir (where the finished runs are)")

    load_before = os.getloadavg()
    extra = [*COMMON, *(QUICK if args.quick else ()), *args.set, f"steps={args.steps}"]
    runs: dict[str, list[dict]] = {arm: [] for arm in args.arms}
    reused: list[str] = []
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = args.output_dir or Path(tmp_name)
        cache = tmp / "cache"
        for i, seed in enumerate(args.seeds):
            order = args.arms[i % len(args.arms) :] + args.arms[: i % len(args.arms)]
            for arm in order:
                out = tmp / f"{arm}_{seed}"
                overrides = [*extra, *ARMS[arm], f"seed={seed}"]
                run = finished_run(out / "summary.json", overrides, args.k) if args.resume else None
                if run is None:
                    rows, wall = run_once(args.recipe, overrides, out, cache)
                    run = {
                        "seed": seed,
                        "overrides": overrides,
                        **summarize_run(rows, wall, args.k),
                    }
                    (out / "summary.json").write_text(json.dumps(run, indent=2))
                else:
                    reused.append(out.name)
                runs[arm].append(run)
                if args.output_dir:  # what is done so far, should the study be cut short
                    (tmp / "progress.json").write_text(json.dumps(runs, indent=2))

    for arm_runs in runs.values():
        arm_runs.sort(key=lambda r: r["seed"])
    arms = {arm: summarize_arm(rs) for arm, rs in runs.items()}
    gains = {arm: [r["gain"] for r in rs] for arm, rs in runs.items()}
    margin = args.margin_frac * abs(arms["bf16"]["gain_mean"])
    comparisons = {
        f"{arm}_minus_bf16": {
            "paired": paired(gains[arm], gains["bf16"], margin),
            "welch": welch(gains[arm], gains["bf16"]),
            "equivalence_tost": equivalence(gains[arm], gains["bf16"], margin),
        }
        for arm in args.arms
        if arm != "bf16"
    }
    out = {
        "benchmark": "fp8_parity",
        "recipe": str(args.recipe.relative_to(REPO) if args.recipe.is_absolute() else args.recipe),
        "overrides": {"common": extra, **{arm: list(ARMS[arm]) for arm in args.arms}},
        "seeds": args.seeds,
        "steps": args.steps,
        "k": args.k,
        "learning_signal": "rollout/reward_mean (arithmetic reward: the success rate)",
        "margin_frac": args.margin_frac,
        "margin": margin,
        "load_average_before": load_before,
        "load_average_after": os.getloadavg(),
        "total_wall_s": time.perf_counter() - start,
        "reused_runs": reused,
        "arms": arms,
        "bf16_gain_t_test": sync_learns(gains["bf16"]),
        "comparisons": comparisons,
        "runs": runs,
    }
    record.finish(out, args)
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()

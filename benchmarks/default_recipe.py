"""The default recipe's acceptance run, measured: `python -m miles_like.train RECIPE` from a cold
cache (the built-in model, the warm start and the C kernels built again: what a fresh clone
does), as a user runs it, once per seed, one after another; then each run's metrics.jsonl
summarized as JSON: wall seconds, reward over the first and last 5 steps and the gain, the worst
engine-vs-trainer log-prob difference over all steps, the PPO-KL of the first update, the idle
share of the steps, and for PPO recipes the critic's value loss and explained variance at the
start and the end.

    python benchmarks/default_recipe.py [RECIPE] [key=value ...] [--seeds 0 1 2] [--save]

The default recipe's goal: a gain of at least +0.4 on every seed, each run within 5 minutes;
another recipe states its own with `--goal-gain` / `--goal-wall-s` (the mixture-of-experts recipe:
`recipes/moe_arith.yaml --goal-gain 0.3 --goal-wall-s 600 --out benchmarks/results/moe_arith.json`).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.run_record import RunRecord, add_output_args  # noqa: E402

DEFAULT_RECIPE = "recipes/tiny_arith_grpo.yaml"
GOAL_GAIN = 0.4
GOAL_WALL_S = 300.0


def mean(xs):
    return sum(xs) / len(xs)


def run_once(recipe: str, overrides: list[str], seed: int | None) -> dict:
    """One cold-cache run of the recipe (with `seed=` when given) and its summary."""
    if seed is not None:
        overrides = [*overrides, f"seed={seed}"]
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "run"
        env = dict(
            os.environ,
            MILES_LIKE_CACHE=str(Path(tmp) / "cache"),
            MILES_LIKE_NATIVE_CACHE=str(Path(tmp) / "native"),
            WANDB_MODE="offline",
        )
        start = time.perf_counter()
        subprocess.run(
            [
                sys.executable,
                "-m",
                "miles_like.train",
                recipe,
                f"tracking.output_dir={out}",
                *overrides,
            ],
            cwd=ROOT,
            env=env,
            check=True,
            stdout=subprocess.DEVNULL,
        )
        wall = time.perf_counter() - start
        rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    reward = [r["rollout/reward_mean"] for r in rows]
    result = {
        "seed": seed,
        "overrides": overrides,
        "steps": len(rows),
        "wall_s": round(wall, 1),
        "load_avg_1m_end": os.getloadavg()[0],
        "reward_first5": mean(reward[:5]),
        "reward_last5": mean(reward[-5:]),
        "reward_gain": mean(reward[-5:]) - mean(reward[:5]),
        "reward_per_step": [round(x, 4) for x in reward],
        "logprob_diff_max_over_steps": max(r["train/logprob_diff_max"] for r in rows),
        "steps_with_logprob_diff_above_1e-5": sum(r["train/logprob_diff_max"] > 1e-5 for r in rows),
        "first_update_ppo_kl_max": max(
            r.get("train/ppo_kl_first_update", r["train/ppo_kl"]) for r in rows
        ),
        "idle_frac_mean": mean([r["perf/idle_s"] / r["perf/step_s"] for r in rows]),
        "step_s_mean": mean([r["perf/step_s"] for r in rows]),
        # what is not a step: Ray and the actors starting, the built-in model, the warm start
        "outside_steps_s": round(wall - sum(r["perf/step_s"] for r in rows), 1),
        "phase_s_mean": {
            k: mean([r.get(f"perf/{k}_s", 0.0) for r in rows])
            for k in ("rollout", "train", "weight_sync")
        },
    }
    if "train/critic_value_loss" in rows[0]:
        v = [r["train/critic_value_loss"] for r in rows]
        ev = [r["train/critic_explained_var"] for r in rows]
        result.update(
            value_loss_first5=mean(v[:5]),
            value_loss_last5=mean(v[-5:]),
            explained_var_first5=mean(ev[:5]),
            explained_var_last5=mean(ev[-5:]),
        )
    return result


def main(argv: list[str]) -> dict:
    record = RunRecord.start("default_recipe", argv)
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("args", nargs="*", metavar="[RECIPE] [key=value ...]")
    parser.add_argument(
        "--seeds",
        type=int,
        nargs="+",
        default=None,
        help="run once per seed (seed=S), one after another; default: the recipe's own seed",
    )
    parser.add_argument(
        "--goal-gain",
        type=float,
        default=GOAL_GAIN,
        help=f"the least reward gain every seed must reach (default {GOAL_GAIN})",
    )
    parser.add_argument(
        "--goal-wall-s",
        type=float,
        default=GOAL_WALL_S,
        help=f"the most wall seconds any run may take (default {GOAL_WALL_S:.0f})",
    )
    add_output_args(parser)
    args = parser.parse_intermixed_args(argv)
    recipe = args.args[0] if args.args and "=" not in args.args[0] else DEFAULT_RECIPE
    overrides = [a for a in args.args if "=" in a]
    runs = [run_once(recipe, overrides, seed) for seed in (args.seeds or [None])]
    result = {
        "recipe": recipe,
        "overrides": overrides,
        "runs": runs,
        "reward_gain_min": min(r["reward_gain"] for r in runs),
        "reward_gain_mean": mean([r["reward_gain"] for r in runs]),
        "wall_s_max": max(r["wall_s"] for r in runs),
        "logprob_diff_max": max(r["logprob_diff_max_over_steps"] for r in runs),
    }
    result["goal"] = {"reward_gain_min": args.goal_gain, "wall_s_max": args.goal_wall_s}
    result["meets_goal"] = (
        result["reward_gain_min"] >= args.goal_gain and result["wall_s_max"] <= args.goal_wall_s
    )
    record.finish(result, args)
    return result


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1:]), indent=2))

"""The default recipe's acceptance run, measured: `python -m miles_like.train RECIPE` from a cold
cache (the warm start included), as a user runs it, then its metrics.jsonl summarized as JSON:
wall seconds, reward over the first and last 5 steps and the gain, the worst engine-vs-trainer
log-prob difference over all steps, the PPO-KL of the first update, the idle share of the steps,
and for PPO recipes the critic's value loss and explained variance at the start and the end.

    python benchmarks/default_recipe.py [RECIPE] [key=value ...]
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


def mean(xs):
    return sum(xs) / len(xs)


def main(argv: list[str]) -> dict:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("args", nargs="*", metavar="[RECIPE] [key=value ...]")
    argv = parser.parse_args(argv).args
    recipe = argv[0] if argv and "=" not in argv[0] else "recipes/tiny_arith_grpo.yaml"
    overrides = [a for a in argv if "=" in a]
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "run"
        env = dict(os.environ, MILES_LIKE_CACHE=str(Path(tmp) / "cache"), WANDB_MODE="offline")
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
        "recipe": recipe,
        "overrides": overrides,
        "steps": len(rows),
        "wall_s": round(wall, 1),
        "cpu_count": os.cpu_count(),
        "load_avg_1m": os.getloadavg()[0],
        "reward_first5": mean(reward[:5]),
        "reward_last5": mean(reward[-5:]),
        "reward_gain": mean(reward[-5:]) - mean(reward[:5]),
        "logprob_diff_max_over_steps": max(r["train/logprob_diff_max"] for r in rows),
        "steps_with_logprob_diff_above_1e-5": sum(r["train/logprob_diff_max"] > 1e-5 for r in rows),
        "first_update_ppo_kl_max": max(
            r.get("train/ppo_kl_first_update", r["train/ppo_kl"]) for r in rows
        ),
        "idle_frac_mean": mean([r["perf/idle_s"] / r["perf/step_s"] for r in rows]),
        "step_s_mean": mean([r["perf/step_s"] for r in rows]),
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


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1:]), indent=2))

"""Does the long-tailed chain recipe learn as well fully asynchronously as synchronously, in
less wall time? Prints one JSON object.

The real controller (`miles_like.run.loop.run`, one local Ray with 2 CPU slots: one engine and one
trainer rank, disaggregated, `cluster.cpu_threads=1`) on `recipes/tiny_chain_learn_grpo.yaml`
(the long-tailed chain task tuned to learn visibly in 60 steps; `--recipe` runs another), in two
modes that differ only in the loop:

* sync: synchronous on-policy (`cluster.off_policy_steps: 0`): each step's rollout is sampled
  by the weights the step trains;
* async: fully asynchronous (`cluster.fully_async: true`, `cluster.max_staleness: 1`): the
  engine keeps generating while the trainer trains; a group is trained at most one weight
  version after its oldest token; running requests continue across an update by `--partial`
  (retract: prefilled again under the new weights, the default; in_place: kept on their K/V).

For each seed (the recipe's `seed`: it changes the random init of the base model, the warm
start's SFT data, the RL prompts and their order, and every sampling seed), one untimed
`steps=1` sync run builds the seed's cached warm start, then the sync and the async run
follow, alternating (sync first on even seeds, async first on odd ones), each for the same
number of steps (same trained samples: `prompts_per_step` groups of `n` a step).

Learning signal: `rollout/reward_mean` of the trained batch, the chain reward (1.0 when the
value after the last "->" is the chain's result), so the success rate. Per run: its mean over
the first k steps and over the last k, the gain (last - first), the sum of `perf/step_s`, the
command's wall time (start-up, warm start cached, included), staleness mean and stale drops.
Summary: mean, standard deviation and standard error of the gain per mode, and the wall time
ratios async / sync (of the means). The margin is stated before the run as a fraction of sync's
mean gain (`--margin-frac`, default 1/3: "async learns within a third of sync's gain").

* Primary test, paired (`paired_async_minus_sync`): a seed's sync and async runs share the base
  model, the warm start and the prompts and their order, so the per-seed difference async -
  sync cancels that part of the seed-to-seed variance. Its mean, sd, SE, the paired t-test
  (two-sided p, 95% CI), the paired TOST at the margin (equivalence: both one-sided tests reject
  at 0.05, i.e. the 90% CI lies inside +-margin) and its lower half alone (non-inferiority:
  async not worse than sync by the margin or more).
* Secondary, unpaired (`gain_async_minus_sync`, `equivalence_tost`): a Welch t-test with its
  95% CI (Welch-Satterthwaite degrees of freedom) and the TOST of two one-sided Welch tests, at
  the same margin; they ignore the pairing, so they are wider.

    python benchmarks/async_learning.py [--seeds 5 --steps 60 --k 15 --partial retract]
    python benchmarks/async_learning.py --quick     # smoke test: 2 seeds, 2 steps, short SFT,
                                                    # no separate warm-start run
    (--output-dir DIR keeps each run's outputs, e.g. its metrics.jsonl, in DIR/MODE_SEED;
    --first-seed S runs seeds S, S + 1, ...: a second process can run more seeds alongside;
    --set KEY=VALUE, repeated, overrides the recipe in both modes)
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.run_record import RunRecord, add_output_args  # noqa: E402

RECIPE = REPO / "recipes" / "tiny_chain_learn_grpo.yaml"
COMMON = (
    "cluster.devices=2",
    "cluster.colocate=false",
    "cluster.cpu_threads=1",
    "checkpoint.every_steps=0",
    "tracking.wandb_project=null",
)
MODES = {
    "sync": ("cluster.off_policy_steps=0",),
    "async": ("cluster.fully_async=true", "cluster.max_staleness=1"),
}
# the smoke test checks the plumbing, not learning: a short warm start, small steps
QUICK = ("sft.steps=4", "rollout.prompts_per_step=8", "trainer.updates_per_rollout=2")
PARTIAL = ("retract", "in_place")  # what an async weight update does to running requests


def start_ray() -> None:
    import ray

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)


def run_once(
    recipe_path: Path, overrides: list[str], out: Path, failures: list[str]
) -> tuple[list[dict], float]:
    """One controller run in this process: its metrics rows and its wall time. A run whose
    actor or Ray node died (`RunFailed`: on a loaded box the raylet can miss its heartbeats) is
    rerun once from scratch on a fresh Ray, and the failure is reported in `failures`."""
    import ray

    from miles_like.errors import RunFailed
    from miles_like.recipe import load_recipe
    from miles_like.run.loop import run

    recipe = load_recipe(recipe_path, [*overrides, f"tracking.output_dir={out}"])
    for attempt in (1, 2):
        start = time.perf_counter()
        try:
            with contextlib.redirect_stdout(sys.stderr):  # stdout is the JSON alone
                code = run(recipe)
            break
        except RunFailed as e:
            failures.append(f"{out.name} attempt {attempt}: {e}")
            if attempt == 2:
                raise
            ray.shutdown()
            start_ray()
    wall = time.perf_counter() - start
    if code != 0:
        raise SystemExit(f"run {out.name} exited {code}")
    lines = (out / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines], wall


def summarize_run(rows: list[dict], wall: float, k: int) -> dict:
    reward = [row["rollout/reward_mean"] for row in rows]
    first, last = statistics.mean(reward[:k]), statistics.mean(reward[-k:])
    return {
        "steps": len(rows),
        "trained_samples": sum(row["rollout/samples"] for row in rows),
        "reward_first_k": first,
        "reward_last_k": last,
        "gain": last - first,
        "step_s_sum": sum(row["perf/step_s"] for row in rows),
        "run_wall_s": wall,
        "staleness_mean": statistics.mean(row.get("rollout/staleness_mean", 0.0) for row in rows),
        "stale_dropped_groups": sum(row.get("rollout/stale_dropped_groups", 0.0) for row in rows),
        "reward_per_step": reward,
    }


def welch(a: list[float], b: list[float]) -> dict:
    """mean(a) - mean(b), its Welch t-test p-value (two-sided) and 95% confidence interval."""
    from scipy import stats

    test = stats.ttest_ind(a, b, equal_var=False)
    ci = test.confidence_interval(0.95)
    return {
        "difference": statistics.mean(a) - statistics.mean(b),
        "t": finite(test.statistic),
        "df": finite(test.df),
        "p_value": finite(test.pvalue),
        "ci95": [finite(ci.low), finite(ci.high)],
    }


def equivalence(a: list[float], b: list[float], margin: float) -> dict:
    """TOST: is mean(a) - mean(b) within (-margin, +margin)? Two one-sided Welch t-tests (H0:
    difference <= -margin, H0: difference >= +margin); equivalence at level 0.05 when both
    reject, i.e. p = the larger p-value < 0.05, i.e. the 90% confidence interval lies inside.
    The lower test alone is non-inferiority: a (async) is not worse than b (sync) by the margin
    or more, whether or not it is better by more."""
    from scipy import stats

    # shifting a by the margin moves the null hypothesis' difference to 0 (spreads unchanged)
    lower = stats.ttest_ind([x + margin for x in a], b, equal_var=False, alternative="greater")
    upper = stats.ttest_ind([x - margin for x in a], b, equal_var=False, alternative="less")
    ci = stats.ttest_ind(a, b, equal_var=False).confidence_interval(0.90)
    p = max(finite(lower.pvalue) or 1.0, finite(upper.pvalue) or 1.0)
    return {
        "margin": margin,
        "p_lower": finite(lower.pvalue),
        "p_upper": finite(upper.pvalue),
        "p_value": p,
        "ci90": [finite(ci.low), finite(ci.high)],
        "equivalent_at_0_05": bool(margin > 0 and p < 0.05),
        "non_inferior_at_0_05": bool(margin > 0 and (finite(lower.pvalue) or 1.0) < 0.05),
    }


def paired(a: list[float], b: list[float], margin: float) -> dict:
    """The paired analysis of a[i] - b[i] (async - sync of the same seed: the seed fixes the
    base model, the warm start and the prompts, so the two runs share that part of their
    variance and the difference cancels it): mean, standard deviation and error, the paired
    t-test (two-sided p, 95% CI), and the paired TOST at `margin` (two one-sided one-sample
    t-tests of the differences, H0: mean <= -margin and H0: mean >= +margin; equivalent at 0.05
    when both reject, i.e. the 90% CI lies inside the margin). The lower test alone is
    non-inferiority: a is not worse than b by the margin or more."""
    from scipy import stats

    if len(a) != len(b):
        raise ValueError(f"paired samples need equal lengths, got {len(a)} and {len(b)}")
    d = [x - y for x, y in zip(a, b)]
    test = stats.ttest_1samp(d, 0.0)
    ci95, ci90 = test.confidence_interval(0.95), test.confidence_interval(0.90)
    lower = stats.ttest_1samp(d, -margin, alternative="greater")
    upper = stats.ttest_1samp(d, margin, alternative="less")
    p_lower, p_upper = finite(lower.pvalue), finite(upper.pvalue)
    p = max(p_lower or 1.0, p_upper or 1.0)
    sd = statistics.stdev(d)
    return {
        "differences": d,
        "mean": statistics.mean(d),
        "sd": sd,
        "se": sd / math.sqrt(len(d)),
        "t": finite(test.statistic),
        "df": len(d) - 1,
        "p_value": finite(test.pvalue),
        "ci95": [finite(ci95.low), finite(ci95.high)],
        "margin": margin,
        "tost_p_lower": p_lower,
        "tost_p_upper": p_upper,
        "tost_p_value": p,
        "ci90": [finite(ci90.low), finite(ci90.high)],
        "equivalent_at_0_05": bool(margin > 0 and p < 0.05),
        "non_inferior_at_0_05": bool(margin > 0 and (p_lower or 1.0) < 0.05),
    }


def finite(x) -> float | None:
    """A float for the JSON; None where the test is undefined (no spread in either mode)."""
    return float(x) if math.isfinite(x) else None


def main() -> None:
    record = RunRecord.start("async_learning")
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", type=int, default=5, help="seeds (runs per mode), >= 2")
    ap.add_argument(
        "--first-seed", type=int, default=0, help="seeds run: first-seed .. first-seed + seeds - 1"
    )
    ap.add_argument("--steps", type=int, default=60, help="RL steps per run")
    ap.add_argument("--k", type=int, default=15, help="steps in the first / last reward window")
    ap.add_argument("--quick", action="store_true", help="smoke test: 2 seeds, 2 steps, k 1")
    ap.add_argument("--output-dir", type=Path, help="keep every run's outputs (metrics.jsonl) here")
    ap.add_argument("--recipe", type=Path, default=RECIPE, help="the recipe both modes run")
    ap.add_argument("--partial", choices=PARTIAL, default="retract", help="async: rollout.partial")
    ap.add_argument(
        "--margin-frac",
        type=float,
        default=1 / 3,
        help="equivalence margin (TOST) as a fraction of sync's mean gain",
    )
    ap.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="recipe override for both modes (repeatable)",
    )
    add_output_args(ap)
    args = ap.parse_args()
    if args.quick:
        args.seeds, args.steps, args.k = 2, 2, 1
    if args.seeds < 2:
        ap.error("--seeds must be >= 2 (a standard deviation and a t-test need two runs a mode)")
    if not 1 <= args.k <= args.steps // 2:
        ap.error(f"--k must be between 1 and --steps / 2 = {args.steps // 2}")

    import ray

    load_before = os.getloadavg()
    extra = [*(QUICK if args.quick else ()), *args.set]
    modes = {**MODES, "async": (*MODES["async"], f"rollout.partial={args.partial}")}
    runs: dict[str, list[dict]] = {mode: [] for mode in modes}
    failures: list[str] = []
    start = time.perf_counter()
    start_ray()
    try:
        with contextlib.ExitStack() as stack:
            tmp = args.output_dir or Path(stack.enter_context(tempfile.TemporaryDirectory()))
            for seed in range(args.first_seed, args.first_seed + args.seeds):
                base = [*COMMON, *extra, f"seed={seed}"]
                if not args.quick:  # the smoke test's 4-step warm start is not worth a run
                    # untimed: builds (or finds) the seed's warm start, so neither mode pays it
                    prepare = tmp / f"prepare_{seed}"
                    run_once(args.recipe, [*base, "steps=1", *modes["sync"]], prepare, failures)
                order = list(modes) if seed % 2 == 0 else list(modes)[::-1]
                for mode in order:
                    rows, wall = run_once(
                        args.recipe,
                        [*base, f"steps={args.steps}", *modes[mode]],
                        tmp / f"{mode}_{seed}",
                        failures,
                    )
                    runs[mode].append({"seed": seed, **summarize_run(rows, wall, args.k)})
    finally:
        ray.shutdown()

    gains = {mode: [r["gain"] for r in rs] for mode, rs in runs.items()}
    mean = {
        mode: {
            key: statistics.mean(r[key] for r in rs)
            for key in ("reward_first_k", "reward_last_k", "gain", "step_s_sum", "run_wall_s")
        }
        | {
            "gain_std": statistics.stdev(gains[mode]),
            "gain_se": statistics.stdev(gains[mode]) / math.sqrt(len(gains[mode])),
        }
        for mode, rs in runs.items()
    }
    margin = args.margin_frac * abs(mean["sync"]["gain"])
    out = {
        "benchmark": "async_learning",
        "host": platform.node(),
        "recipe": str(args.recipe),
        "overrides": {"common": [*COMMON, *extra], **{m: list(o) for m, o in modes.items()}},
        "seeds": args.seeds,
        "first_seed": args.first_seed,
        "steps": args.steps,
        "k": args.k,
        "learning_signal": "rollout/reward_mean (chain reward: the success rate)",
        "load_average_before": load_before,
        "load_average_after": os.getloadavg(),
        "total_wall_s": time.perf_counter() - start,
        "mean": mean,
        "gain_async_minus_sync": welch(gains["async"], gains["sync"]),
        "margin_frac": args.margin_frac,
        "paired_async_minus_sync": paired(gains["async"], gains["sync"], margin),
        "equivalence_tost": equivalence(gains["async"], gains["sync"], margin),
        "sync_gain_t_test": sync_learns(gains["sync"]),
        "wall_ratio_async_over_sync": {
            key: mean["async"][key] / mean["sync"][key] for key in ("step_s_sum", "run_wall_s")
        },
        "failed_attempts_rerun": failures,
        "runs": runs,
    }
    record.finish(out, args)
    print(json.dumps(out, indent=2))


def sync_learns(gains: list[float]) -> dict:
    """Whether sync's gain is above its seed-to-seed noise: one-sample t-test of gain > 0."""
    from scipy import stats

    test = stats.ttest_1samp(gains, 0.0, alternative="greater")
    return {"t": finite(test.statistic), "p_value_gain_gt_0": finite(test.pvalue)}


if __name__ == "__main__":
    main()

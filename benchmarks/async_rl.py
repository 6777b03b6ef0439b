"""The rollout tail on a long-tailed workload: over-sampling + partial rollouts vs a plain
rollout. Prints one JSON object.

One engine (`AsyncEngine` on a random-init tiny Qwen2, CPU or GPU), one process. Each round is
one RL step's rollout of `--prompts` groups of `--n` samples; the length of every group is drawn
from a heavy-tailed (Pareto) distribution and enforced with `ignore_eos` + a per-request
`max_new_tokens`, so a few groups are many times longer than the rest (the long tail of real RL
responses). The two modes alternate round by round in the same run, on the same draws:

* plain: the round's groups, waited for to the last sample (today's rollout);
* over-sampled + retract: ceil(prompts x over_sampling) groups are launched (the groups carried
  from the previous round first, then fresh ones); once `--prompts` groups are complete the
  engine aborts the rest at its next step (the same `AsyncEngine` quota the controller uses,
  `rollout.over_sampling` / `rollout.partial: retract`), and they continue next round from the
  tokens they have (prompt + tokens prefilled again, the rest of their length to go).

Tail time: from the moment 90% of the round's trained samples (prompts x n) are done to the
moment the round's batch is complete (plain: its last sample; over-sampled: the quota). Rollout
time: the round's wall time. Medians over the rounds of each mode; the goal is a >= 3x shorter
tail.

`async_vs_sync`: the real controller (`miles_like.run.loop.run`, one local Ray
with 2 CPU slots: one engine + one trainer rank, disaggregated) on the long-tailed chain recipe
(`recipes/tiny_chain_grpo.yaml`, its cached warm start), synchronous on-policy
(`off_policy_steps: 0`) and fully asynchronous (`cluster.fully_async`, `max_staleness: 1`)
runs alternating in the same process, `--train-runs` of each; one async mode per
`--partial` (retract: updates abort running requests, which continue prefilled again;
in_place: updates keep them running on their K/V). Trained samples per second of a
run: the samples its steps trained over the sum of their `perf/step_s`, the first step
(warm-up: first forward passes, first broadcast) left out; with each mode's mean
`perf/engine_busy_frac`, `trainer_busy_frac` and `device_idle_frac`, and where an async step's
time goes (`perf/*_s` means: waiting for a batch, training, the weight update's pieces, the
controller's accounting; `trainer_busy_s`: the trainer's compute). `--take-ahead on,off` adds,
per partial mode, async runs with `cluster.take_ahead=false` (the next batch taken after the
update) to the rotation: that switch's A/B in the same process. The goal is >= 1.6x.
`--train-runs 0` skips it.

    python benchmarks/async_rl.py [--rounds 6 --prompts 16 --n 4 --over-sampling 1.5]
                                  [--train-runs 2 --train-steps 8 --partial retract,in_place]
                                  [--take-ahead on,off]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import platform
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.run_record import RunRecord, add_output_args  # noqa: E402
from rollout import Engine, EngineConfig, SamplingParams  # noqa: E402
from rollout.async_engine import AsyncEngine  # noqa: E402
from rollout.random_checkpoint import TINY_QWEN2, write_random_checkpoint  # noqa: E402


def draw_lengths(rng: random.Random, count: int, args) -> list[int]:
    """Heavy-tailed group lengths: min_tokens x Pareto(alpha), capped."""
    return [
        min(args.max_tokens, int(args.min_tokens * rng.paretovariate(args.alpha)))
        for _ in range(count)
    ]


class Group:
    """A group's prompt, target length and its samples' tokens so far."""

    def __init__(self, prompt: list[int], length: int, n: int):
        self.prompt, self.length = prompt, length
        self.tokens: list[list[int]] = [[] for _ in range(n)]
        self.done = [False] * n


def run_round(engine: AsyncEngine, groups: list[Group], quota: int | None, seed: int, n: int):
    """Generate `groups` (one request per unfinished sample); returns (complete group ids in
    order, time each trained sample was done, round wall time, batch-complete time)."""
    requests, owners = [], []
    ready = [g for g, group in enumerate(groups) if all(group.done)]  # complete already
    for g, group in enumerate(groups):
        if g in ready:
            continue
        fresh = not any(group.tokens)
        if fresh and not any(group.done):
            params = SamplingParams(
                n=n, max_new_tokens=group.length, seed=seed + 97 * g, ignore_eos=True
            )
            requests.append((group.prompt, params))
            owners.append((g, list(range(n))))
            continue
        for j in range(n):
            if group.done[j]:
                continue
            left = group.length - len(group.tokens[j])
            params = SamplingParams(
                n=1, max_new_tokens=left, seed=seed + 97 * g + j, ignore_eos=True
            )
            requests.append((group.prompt + group.tokens[j], params))
            owners.append((g, [j]))
    start = time.perf_counter()
    done_at: dict[int, float] = {}
    want = (quota if quota is not None else len(groups)) - len(ready)
    futures = engine.submit_many(requests, groups=[g for g, _ in owners], quota=max(want, 1))
    for f in futures:
        f.add_done_callback(lambda f: done_at.setdefault(id(f), time.perf_counter()))
    complete = ready + AsyncEngine.complete_groups(futures).result()
    batch_done = time.perf_counter()
    sample_times: list[float] = []
    for f, (g, js) in zip(futures, owners):
        result = f.result()
        for j, s in zip(js, result.samples):
            groups[g].tokens[j] += list(s.token_ids)
            groups[g].done[j] = s.finish_reason != "abort"
            if g in complete[: quota or len(groups)]:
                sample_times.append(done_at[id(f)] - start)
    wall = time.perf_counter() - start
    return complete, sample_times, wall, batch_done - start


def tail(sample_times: list[float], batch_s: float) -> float:
    times = sorted(sample_times)
    k = max(0, math.ceil(0.9 * len(times)) - 1)
    return batch_s - times[k]


def main() -> None:
    record = RunRecord.start("async_rl")
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=6, help="rounds per mode (alternating)")
    ap.add_argument("--prompts", type=int, default=16, help="groups per batch")
    ap.add_argument("--n", type=int, default=4, help="samples per group")
    ap.add_argument("--over-sampling", type=float, default=1.5)
    ap.add_argument("--min-tokens", type=int, default=4, help="Pareto scale of group lengths")
    ap.add_argument("--alpha", type=float, default=1.2, help="Pareto shape (smaller: heavier)")
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--train-runs", type=int, default=2, help="async_vs_sync: runs per mode")
    ap.add_argument("--train-steps", type=int, default=8, help="async_vs_sync: steps per run")
    ap.add_argument("--skip-tail", action="store_true", help="only async_vs_sync")
    ap.add_argument(
        "--pin-cpus", action="store_true", help="async_vs_sync: cluster.pin_cpus=true in every run"
    )
    ap.add_argument(
        "--partial",
        default="retract,in_place",
        help="async_vs_sync: the async runs' rollout.partial, one run of each per round "
        "(comma-separated: retract, in_place)",
    )
    ap.add_argument(
        "--take-ahead",
        default="on",
        help="async_vs_sync: cluster.take_ahead of the async runs, one run of each per round "
        "(comma-separated: on, off; off modes are named *_no_take_ahead)",
    )
    add_output_args(ap)
    args = ap.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        model = write_random_checkpoint(Path(tmp) / "model", TINY_QWEN2, seed=0)
        total = args.prompt_len + args.max_tokens + 8
        engine = AsyncEngine(
            Engine(
                EngineConfig(
                    model_path=str(model),
                    device=args.device,
                    dtype="float32",
                    kv_cache_tokens=2
                    * total
                    * math.ceil(args.prompts * args.over_sampling)
                    * args.n,
                    max_model_len=total,
                )
            )
        )
        try:
            out = {} if args.skip_tail else measure(engine, args)
        finally:
            engine.close()
    out["async_vs_sync"] = (
        async_vs_sync(args) if args.train_runs else {"measured": False, "why": "--train-runs 0"}
    )
    record.finish(out, args)
    print(json.dumps(out, indent=2))


def measure(engine: AsyncEngine, args) -> dict:
    rng = random.Random(args.seed)
    vocab = TINY_QWEN2["vocab_size"]
    launched = math.ceil(args.prompts * args.over_sampling - 1e-9)

    def fresh(count: int) -> list[Group]:
        return [
            Group([rng.randrange(vocab) for _ in range(args.prompt_len)], length, args.n)
            for length in draw_lengths(rng, count, args)
        ]

    run_round(engine, fresh(2), None, 1, args.n)  # warm-up (allocations, first kernels)
    plain, over, carried = [], [], []
    for r in range(args.rounds):
        # plain: a fresh batch, to the last sample
        _, times, wall, batch_s = run_round(engine, fresh(args.prompts), None, 1000 + r, args.n)
        plain.append({"tail_s": tail(times, batch_s), "rollout_s": wall})
        # over-sampled + retract: carried groups first, then fresh ones
        groups = carried + fresh(launched - len(carried))
        complete, times, wall, batch_s = run_round(engine, groups, args.prompts, 2000 + r, args.n)
        batch = set(complete[: args.prompts])
        carried = [g for i, g in enumerate(groups) if i not in batch]
        over.append(
            {
                "tail_s": tail(times, batch_s),
                "rollout_s": wall,
                "carried_groups": len(carried),
                "carried_unfinished_samples": sum(not d for g in carried for d in g.done),
            }
        )
    med = {
        mode: {k: statistics.median(row[k] for row in rows) for k in ("tail_s", "rollout_s")}
        for mode, rows in (("plain", plain), ("over_sampled_retract", over))
    }
    return {
        "benchmark": "async_rl",
        "device": args.device,
        "host": platform.node(),
        "load_average": os.getloadavg(),
        "workload": {
            "groups_per_batch": args.prompts,
            "n": args.n,
            "over_sampling": args.over_sampling,
            "group_length": f"min({args.max_tokens}, int({args.min_tokens} x "
            f"Pareto({args.alpha})))",
            "rounds_per_mode": args.rounds,
        },
        "median": med,
        "tail_ratio_plain_over_partial": med["plain"]["tail_s"]
        / max(med["over_sampled_retract"]["tail_s"], 1e-9),
        "rollout_ratio_plain_over_partial": med["plain"]["rollout_s"]
        / max(med["over_sampled_retract"]["rollout_s"], 1e-9),
        "rounds": {"plain": plain, "over_sampled_retract": over},
    }


FRACTIONS = ("engine_busy_frac", "trainer_busy_frac", "device_idle_frac")
ASYNC_MODE = {"retract": "async", "in_place": "async_in_place"}


def step_breakdown(rows: list[dict]) -> dict:
    """Mean seconds per step of every perf/*_s phase the rows have (phases a step skipped count
    0), and of the trainer's compute (`trainer_busy_frac` x `step_s`)."""
    keys = sorted({k for row in rows for k in row if k.startswith("perf/") and k.endswith("_s")})
    out = {k[len("perf/") :]: statistics.mean(row.get(k, 0.0) for row in rows) for k in keys}
    out["trainer_busy_s"] = statistics.mean(
        row["perf/trainer_busy_frac"] * row["perf/step_s"] for row in rows
    )
    return out


def async_vs_sync(args) -> dict:
    """Trained samples per second, fully async (max_staleness 1) vs sync, alternating runs."""
    import ray

    from miles_like.recipe import load_recipe
    from miles_like.run.loop import run

    recipe_path = REPO / "recipes" / "tiny_chain_grpo.yaml"
    common = [
        f"steps={args.train_steps}",
        "cluster.devices=2",
        "cluster.colocate=false",
        "cluster.cpu_threads=1",
        "checkpoint.every_steps=0",
        "tracking.wandb_project=null",
        *(["cluster.pin_cpus=true"] if args.pin_cpus else []),
    ]
    modes = {"sync": []}
    for partial in args.partial.split(","):
        if partial not in ("retract", "in_place"):
            raise SystemExit(f"--partial {partial!r}: use retract and / or in_place")
        for ahead in args.take_ahead.split(","):
            if ahead not in ("on", "off"):
                raise SystemExit(f"--take-ahead {ahead!r}: use on and / or off")
            name = ASYNC_MODE[partial] + ("" if ahead == "on" else "_no_take_ahead")
            modes[name] = [
                "cluster.fully_async=true",
                "cluster.max_staleness=1",
                f"rollout.partial={partial}",
                f"cluster.take_ahead={'true' if ahead == 'on' else 'false'}",
            ]
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    runs: dict[str, list[dict]] = {mode: [] for mode in modes}
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for r in range(args.train_runs):
                for mode, overrides in modes.items():
                    out = Path(tmp) / f"{mode}_{r}"
                    recipe = load_recipe(
                        recipe_path, [*common, *overrides, f"tracking.output_dir={out}"]
                    )
                    start = time.perf_counter()
                    with contextlib.redirect_stdout(sys.stderr):  # stdout is the JSON alone
                        assert run(recipe) == 0
                    wall = time.perf_counter() - start
                    lines = (out / "metrics.jsonl").read_text().splitlines()
                    rows = [json.loads(line) for line in lines][1:]
                    step_s = sum(row["perf/step_s"] for row in rows)
                    runs[mode].append(
                        {
                            "samples_per_s": sum(row["rollout/samples"] for row in rows) / step_s,
                            "step_s_mean": step_s / len(rows),
                            "run_wall_s": wall,
                            "reward_first": rows[0]["rollout/reward_mean"],
                            "reward_last": rows[-1]["rollout/reward_mean"],
                            **{
                                k: statistics.mean(row[f"perf/{k}"] for row in rows)
                                for k in FRACTIONS
                            },
                            **(
                                {
                                    "taken_ahead_frac": statistics.mean(
                                        row["rollout/taken_ahead"] for row in rows
                                    ),
                                    "staleness_mean": statistics.mean(
                                        row["rollout/staleness_mean"] for row in rows
                                    ),
                                    "stale_dropped_groups": sum(
                                        row["rollout/stale_dropped_groups"] for row in rows
                                    ),
                                }
                                if mode != "sync"
                                else {}
                            ),
                            **step_breakdown(rows),
                        }
                    )
    finally:
        ray.shutdown()
    mean = {
        mode: {k: statistics.mean(run_.get(k, 0.0) for run_ in rs) for k in rs[0]}
        for mode, rs in runs.items()
    }
    return {
        "measured": True,
        "recipe": "recipes/tiny_chain_grpo.yaml",
        "overrides": common,
        "runs_per_mode": args.train_runs,
        "mean": mean,
        # the retract mode's key keeps its old name
        **{
            ("speedup_samples_per_s" if mode == "async" else f"speedup_{mode}"): mean[mode][
                "samples_per_s"
            ]
            / mean["sync"]["samples_per_s"]
            for mode in mean
            if mode != "sync"
        },
        "speedups_per_round": {
            mode: [a["samples_per_s"] / s["samples_per_s"] for a, s in zip(rs, runs["sync"])]
            for mode, rs in runs.items()
            if mode != "sync"
        },
        "goal": 1.6,
        "runs": runs,
        "load_average_after": os.getloadavg(),
    }


if __name__ == "__main__":
    main()

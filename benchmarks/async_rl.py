"""The rollout tail on a long-tailed workload: over-sampling + partial rollouts vs a plain
rollout (issue 14, acceptance). Prints one JSON object.

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

The async-vs-sync part of the acceptance (`cluster.async`, issue 14 item 6: trained samples per
second, fully asynchronous with max_staleness 1 vs synchronous) is not measured here: that mode
does not exist yet. Its place in the output is `async_vs_sync`, which says so.

    python benchmarks/async_rl.py [--rounds 6 --prompts 16 --n 4 --over-sampling 1.5]
"""

from __future__ import annotations

import argparse
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
            out = measure(engine, args)
        finally:
            engine.close()
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
        "async_vs_sync": {
            "measured": False,
            "why": "cluster.async (issue 14 item 6) is not implemented yet; nothing to compare",
        },
    }


if __name__ == "__main__":
    main()

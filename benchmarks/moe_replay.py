"""What rollout routing replay costs on the mixture-of-experts recipe (`recipes/moe_arith.yaml`):
a few RL steps with `algorithm.routing_replay` rollout and off, alternating runs (on, off, off,
on, ...) so a drift of the machine's load falls on both, all from one warm start (one cache, the
first run builds it). Reported as JSON: the route bytes shipped per trained token
(`rollout/route_bytes / rollout/route_tokens`) and per step, and the step-time cost of replay:
the median `perf/step_s` and `perf/train_s` with replay on over off (the first `--skip` steps of
every run left out: they carry one-time compilation and allocation).

    python benchmarks/moe_replay.py [--steps 8] [--pairs 2] [--save]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.run_record import RunRecord, add_output_args  # noqa: E402

RECIPE = "recipes/moe_arith.yaml"
MODES = ("rollout", "off")


def run_once(mode: str, steps: int, cache: Path, out: Path, overrides: list[str]) -> list[dict]:
    """One run of the recipe with `algorithm.routing_replay=mode`; its metrics rows."""
    env = dict(
        os.environ,
        MILES_LIKE_CACHE=str(cache / "models"),
        MILES_LIKE_NATIVE_CACHE=str(cache / "native"),
        WANDB_MODE="offline",
    )
    subprocess.run(
        [
            sys.executable,
            "-m",
            "miles_like.train",
            RECIPE,
            f"steps={steps}",
            f"algorithm.routing_replay={mode}",
            "checkpoint.every_steps=0",
            f"tracking.output_dir={out}",
            *overrides,
        ],
        cwd=ROOT,
        env=env,
        check=True,
        stdout=subprocess.DEVNULL,
    )
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def median_of(rows: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in rows)


def main(argv: list[str]) -> dict:
    record = RunRecord.start("moe_replay", argv)
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=8, help="RL steps per run")
    parser.add_argument("--skip", type=int, default=2, help="first steps of each run left out")
    parser.add_argument("--pairs", type=int, default=2, help="runs with replay on and off each")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="recipe overrides")
    add_output_args(parser)
    args = parser.parse_intermixed_args(argv)
    if args.steps <= args.skip:
        parser.error(f"--steps {args.steps} must exceed --skip {args.skip}")
    runs: list[dict] = []
    kept: dict[str, list[dict]] = {m: [] for m in MODES}
    with tempfile.TemporaryDirectory() as tmp:
        for pair in range(args.pairs):
            for mode in MODES if pair % 2 == 0 else MODES[::-1]:
                out = Path(tmp) / f"run{len(runs)}"
                start = time.perf_counter()
                rows = run_once(mode, args.steps, Path(tmp) / "cache", out, args.overrides)
                wall = time.perf_counter() - start
                measured = rows[args.skip :]
                kept[mode] += measured
                runs.append(
                    {
                        "routing_replay": mode,
                        "wall_s": round(wall, 1),
                        "load_avg_1m_end": os.getloadavg()[0],
                        "step_s_median": median_of(measured, "perf/step_s"),
                        "train_s_median": median_of(measured, "perf/train_s"),
                    }
                )
    on, off = kept["rollout"], kept["off"]
    route_bytes = sum(r["rollout/route_bytes"] for r in on)
    route_tokens = sum(r["rollout/route_tokens"] for r in on)
    samples = sum(r["rollout/samples"] for r in on)
    result = {
        "recipe": RECIPE,
        "overrides": args.overrides,
        "steps_per_run": args.steps,
        "steps_skipped_per_run": args.skip,
        "runs": runs,
        "route_bytes_per_token": route_bytes / route_tokens,
        "route_bytes_per_step_median": median_of(on, "rollout/route_bytes"),
        "route_tokens_per_sample": route_tokens / samples,
        "route_bytes_over_weight_sync_bytes": route_bytes
        / sum(r["perf/weight_sync_bytes"] for r in on),
        "step_s_median": {"on": median_of(on, "perf/step_s"), "off": median_of(off, "perf/step_s")},
        "train_s_median": {
            "on": median_of(on, "perf/train_s"),
            "off": median_of(off, "perf/train_s"),
        },
    }
    result["replay_cost"] = {
        "step_s_on_over_off": result["step_s_median"]["on"] / result["step_s_median"]["off"],
        "train_s_on_over_off": result["train_s_median"]["on"] / result["train_s_median"]["off"],
    }
    record.finish(result, args)
    return result


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1:]), indent=2))

"""The RL loop (DESIGN.md, "One step of the loop"), every phase timed:

    rollout (generate + score) -> [engines release memory] -> advantages -> train
    -> [engines resume] weight sync -> log / checkpoint

With `cluster.off_policy_steps: 1` (disaggregated) the rollout of step k+1 is launched right
after step k's samples arrive (and the weights are synced), so it runs on the engines while the
trainer trains on step k: the samples are at most one weight version old.
`perf/idle_s` is the step's wall time outside every timed phase: the controller's own overhead.
"""

from __future__ import annotations

import shutil
import time
from contextlib import contextmanager
from pathlib import Path

import ray
from tqdm import tqdm

from miles_like.batch import samples_batch, with_advantages
from miles_like.recipe import Recipe, recipe_to_yaml
from miles_like.runtime import Runtime
from miles_like.schema import RecipeError, to_plain
from miles_like.tracking import Tracker


class PhaseTimer:
    def __init__(self):
        self.seconds: dict[str, float] = {}

    @contextmanager
    def __call__(self, phase: str):
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[phase] = self.seconds.get(phase, 0.0) + time.perf_counter() - start


def run(recipe: Recipe) -> int:
    if recipe.checkpoint.resume:
        raise RecipeError("checkpoint.resume: exact resume is not implemented yet; the saved "
                          "checkpoints are Hugging Face directories: point model.path at one")
    out = Path(recipe.tracking.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "recipe.yaml").write_text(recipe_to_yaml(recipe))
    rt = Runtime(recipe, log=tqdm.write)
    tracker = Tracker(out, to_plain(recipe), wandb_project=recipe.tracking.wandb_project,
                      wandb_mode=recipe.tracking.wandb_mode, print_fn=tqdm.write)
    if rt.source.skipped:
        tqdm.write(f"data: skipped rows {rt.source.skipped}")
    off_policy = recipe.cluster.off_policy_steps == 1
    try:
        pending = rt.rollouts.launch(0)
        for step in tqdm(range(recipe.steps), desc="RL steps", unit="step"):
            timer, start = PhaseTimer(), time.perf_counter()
            sync_bytes = 0.0
            with timer("rollout"):
                rollout = rt.rollouts.finish(pending)
            if off_policy and step + 1 < recipe.steps:
                if step > 0:  # the engines take the newest weights before their next rollout
                    with timer("weight_sync"):
                        sync_bytes = rt.sync_weights()
                pending = rt.rollouts.launch(step + 1)
            with timer("advantages"):
                batch = samples_batch(rollout.groups)
                ref = ray.put(batch)
                values = rt.values(ref) if recipe.algorithm.advantage == "gae" else None
                ref_lp = rt.ref_logprobs(ref) if recipe.algorithm.kl_reward_coef > 0 else None
                batch, adv_metrics = with_advantages(batch, rollout.groups, recipe.algorithm,
                                                     values=values, ref_logprobs=ref_lp)
            with timer("train"):
                train_metrics = rt.train(batch)
            if not off_policy:
                with timer("weight_sync"):
                    sync_bytes = rt.sync_weights()
                if step + 1 < recipe.steps:
                    with timer("rollout"):
                        pending = rt.rollouts.launch(step + 1)
            if recipe.checkpoint.every_steps and (step + 1) % recipe.checkpoint.every_steps == 0:
                with timer("checkpoint"):
                    save_checkpoint(rt, out, step + 1, recipe.checkpoint.keep_last)
            step_s = time.perf_counter() - start
            row = {"step": step,
                   **{f"rollout/{k}": v for k, v in rollout.metrics.items()},
                   **{f"rollout/{k}": v for k, v in adv_metrics.items()},
                   **{f"train/{k}": v for k, v in train_metrics.items()},
                   **{f"perf/{k}_s": v for k, v in timer.seconds.items()},
                   "perf/step_s": step_s, "perf/weight_sync_bytes": sync_bytes}
            row.setdefault("perf/weight_sync_s", 0.0)
            row["perf/idle_s"] = max(0.0, step_s - sum(timer.seconds.values()))
            row["perf/idle_frac"] = row["perf/idle_s"] / step_s
            tracker.log(row)
    finally:
        plot = tracker.finish()
        rt.shutdown()
    tqdm.write(f"done: {tracker.path}" + (f", {plot}" if plot else ""))
    return 0


def save_checkpoint(rt: Runtime, out: Path, step: int, keep_last: int) -> Path:
    """A Hugging Face directory of the policy at `step` (atomic: written, then renamed); only
    the newest `keep_last` are kept."""
    root = out / "checkpoints"
    final, tmp = root / f"step_{step:06d}", root / f".tmp-step_{step:06d}"
    shutil.rmtree(tmp, ignore_errors=True)
    rt.save_checkpoint(tmp)
    shutil.rmtree(final, ignore_errors=True)
    tmp.rename(final)
    for old in sorted(p for p in root.glob("step_*") if p.is_dir())[:-keep_last]:
        shutil.rmtree(old)
    return final

"""The RL loop (DESIGN.md, "One step of the loop"), every phase timed:

    rollout (generate + score) -> [engines release memory] -> advantages -> train
    -> [engines resume] weight sync -> log / checkpoint

With `cluster.off_policy_steps: 1` (disaggregated) the rollout of step k+1 is launched right
after step k's samples arrive (and the weights are synced), so it runs on the engines while the
trainer trains on step k: the samples are at most one weight version old.
`perf/idle_s` is the step's wall time outside every timed phase: the controller's own overhead.

Checkpoints (`checkpoint.py`) are taken at the end of a step, when the next step's rollout is
already launched: they record the data position from before that launch, so a resumed run
launches the same rollout again (same prompts, same seeds; off-policy, with the engine-side
weights saved right after the launch). The step's metrics row is written into the checkpoint
before it is marked complete, and logged after.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from pathlib import Path

import ray
import torch
from tqdm import tqdm

from config_schema import to_plain
from miles_like.errors import RunFailed
from miles_like.recipe import Recipe, recipe_to_yaml
from miles_like.run import checkpoint, rng_state
from miles_like.run.busy import BusyAccounting
from miles_like.run.calls import ActorDied, CallTimeout
from miles_like.run.runtime import Runtime
from miles_like.run.tracking import Tracker, json_row
from miles_like.scoring.batch import samples_batch, with_advantages


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
    out = Path(recipe.tracking.output_dir)
    resume = checkpoint.resolve_resume(recipe, log=tqdm.write)
    state = checkpoint.read_state(resume) if resume is not None else None
    if state is None and recipe.checkpoint.every_steps:
        checkpoint.refuse_earlier_run(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "recipe.yaml").write_text(recipe_to_yaml(recipe))
    with _stops_cleanly(out):
        rt = Runtime(recipe, log=tqdm.write, resume=resume, state=state)
    first = state["next_step"] if state else 0
    try:
        tracker = Tracker(
            out,
            to_plain(recipe),
            wandb_project=recipe.tracking.wandb_project,
            wandb_mode=recipe.tracking.wandb_mode,
            print_fn=tqdm.write,
            **(
                {
                    "resume_step": first,
                    "last_row": state["last_row"],
                    "wandb_run_id": state["wandb_run_id"],
                }
                if state
                else {}
            ),
        )
    except BaseException:
        rt.shutdown()
        raise
    if resume is not None:
        rng_state.restore(torch.load(resume / checkpoint.CONTROLLER_FILE, weights_only=True))
    if rt.source.skipped:
        tqdm.write(f"data: skipped rows {rt.source.skipped}")
    if first >= recipe.steps:
        tqdm.write(
            f"resume: the checkpoint is at step {first} of steps={recipe.steps}; nothing "
            "to do (raise steps to train further)"
        )
    failed = True
    try:
        with _stops_cleanly(out):
            if recipe.cluster.fully_async:
                from miles_like.run import async_loop

                async_loop.steps(recipe, rt, tracker, out, first)
            else:
                _steps(recipe, rt, tracker, out, first)
        failed = False
    finally:
        plot = tracker.finish()
        rt.shutdown(graceful=not failed)
    tqdm.write(f"done: {tracker.path}" + (f", {plot}" if plot else ""))
    return 0


@contextmanager
def _stops_cleanly(out: Path):
    """An actor's death or a call's timeout becomes `RunFailed`: one line naming the actor and
    saying how to continue (the complete checkpoints are intact: a checkpoint is complete only
    once renamed)."""
    try:
        yield
    except (ActorDied, CallTimeout) as e:
        what = f"{e.actor} died: {e.reason}" if isinstance(e, ActorDied) else str(e)
        found = checkpoint.complete_checkpoints(out)
        then = (
            "resume with checkpoint.resume=auto"
            if found
            else "no checkpoint to resume from yet (checkpoint.every_steps); run it again"
        )
        raise RunFailed(f"{what}; {then}") from None


def _steps(recipe: Recipe, rt: Runtime, tracker: Tracker, out: Path, first: int) -> None:
    """Steps `first` .. recipe.steps - 1."""
    off_policy = recipe.cluster.off_policy_steps == 1
    every = recipe.checkpoint.every_steps
    pending = rt.rollouts.launch(first) if first < recipe.steps else None
    busy = BusyAccounting(rt)
    for step in tqdm(
        range(first, recipe.steps), initial=first, total=recipe.steps, desc="RL steps", unit="step"
    ):
        timer, start, wall_start = PhaseTimer(), time.perf_counter(), time.time()
        sync_bytes = 0.0
        ckpt = checkpoint.begin(out, step + 1) if every and (step + 1) % every == 0 else None
        with timer("rollout"):
            rollout = rt.rollouts.finish(pending)
            busy.rollout_finished(pending.started)
            pending = None
        if off_policy and step + 1 < recipe.steps:
            if step > 0:  # the engines take the newest weights before their next rollout
                with timer("weight_sync"):
                    sync_bytes = rt.sync_weights()
            else:  # every rollout starts from an empty prefix cache (as after a resume)
                rt.flush_prefix_caches()
            pending = rt.rollouts.launch(step + 1)
        if off_policy and ckpt is not None:
            with timer("checkpoint"):  # the weights `pending` is generated with
                rt.save_engine_weights(ckpt)
        with timer("advantages"):
            batch, adv_metrics = batch_with_advantages(recipe, rt, rollout.groups)
        with timer("train"):
            train_metrics = rt.train(batch)
        if not off_policy:
            with timer("weight_sync"):
                sync_bytes = rt.sync_weights()
            if step + 1 < recipe.steps:
                with timer("rollout"):
                    pending = rt.rollouts.launch(step + 1)
        if ckpt is not None:
            with timer("checkpoint"):
                rt.save_checkpoint(ckpt)
        step_s = time.perf_counter() - start
        row = {
            "step": step,
            **{f"rollout/{k}": v for k, v in rollout.metrics.items()},
            **{f"rollout/{k}": v for k, v in adv_metrics.items()},
            **{f"train/{k}": v for k, v in train_metrics.items()},
            **{f"perf/{k}_s": v for k, v in timer.seconds.items()},
            "perf/step_s": step_s,
            "perf/weight_sync_bytes": sync_bytes,
            # the most one trainer rank sent (resharding sync: its own shards only)
            "perf/weight_sync_bytes_per_rank": rt.sync_bytes_per_rank if sync_bytes else 0.0,
        }
        row.setdefault("perf/weight_sync_s", 0.0)
        row["perf/idle_s"] = max(0.0, step_s - sum(timer.seconds.values()))
        row["perf/idle_frac"] = row["perf/idle_s"] / step_s
        # engines' and trainer's own compute intervals (after step_s: not part of the step)
        row.update(busy.step_done(wall_start, wall_start + step_s, pending and pending.started))
        if ckpt is not None:  # complete only now: the row is part of the checkpoint
            torch.save(rng_state.capture(), ckpt / checkpoint.CONTROLLER_FILE)
            rt.commit_checkpoint(ckpt, _controller_state(rt, tracker, step + 1, pending, row))
        tracker.log(row)


def advantages_ask_trainer(recipe: Recipe) -> bool:
    """Whether `batch_with_advantages` calls the trainer (the critic's values, the reference's
    log-probs)."""
    return recipe.algorithm.advantage == "gae" or recipe.algorithm.kl_reward_coef > 0


def batch_with_advantages(recipe: Recipe, rt: Runtime, groups) -> tuple:
    """The trainer's batch of `groups` with its advantages (and their metrics), asking the
    critic for values (GAE) and the reference model for log-probs (KL in the reward) where the
    algorithm needs them."""
    batch = samples_batch(groups)
    gae, kl = recipe.algorithm.advantage == "gae", recipe.algorithm.kl_reward_coef > 0
    ref = ray.put(batch) if gae or kl else None  # one copy for both calls; none without them
    values = rt.values(ref) if gae else None
    ref_lp = rt.ref_logprobs(ref) if kl else None
    return with_advantages(batch, groups, recipe.algorithm, values=values, ref_logprobs=ref_lp)


def _controller_state(rt: Runtime, tracker: Tracker, next_step: int, pending, row) -> dict:
    """state.json: where the loop stands before `next_step`. The data position is the one
    before the pending rollout drew its prompts: a resumed run draws them again."""
    consumed = pending.consumed_before if pending else rt.source.consumed
    # over-sampling with retract: the partial groups the pending rollout continues
    carried = {"carried": rt.rollouts.carry_state(pending)} if rt.rollouts.streaming else {}
    return controller_state(rt, tracker, next_step, consumed, row, **carried)


def controller_state(
    rt: Runtime, tracker: Tracker, next_step: int, consumed: int, row, **rollout_state
) -> dict:
    """state.json of either loop: the step, the data position `consumed`, the weights' version,
    the layout, the last metrics row, and what the loop's rollouts carry (`rollout_state`)."""
    return {
        "next_step": next_step,
        "data_consumed": consumed,
        "data_epoch": rt.source.epoch_at(consumed),
        "weight_version": rt.weight_version,
        "wandb_run_id": tracker.wandb_run_id,
        **rt.layout_state(),
        "last_row": json_row(row),
        **rollout_state,
    }

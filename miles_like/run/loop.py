"""The RL loop (DESIGN.md, "One step of the loop"), every phase timed. A step, colocated:

    rollout (generate + score) -> engines release the devices, the trainer onloads
    -> advantages (the critic's values, the reference's log-probs) -> train
    -> the trainer offloads its optimizer state -> engines resume their weights -> weights pushed
    -> the trainer offloads its weights -> engines allocate their KV cache -> [checkpoint] -> log

The hand-over after training is staged so that the device never holds the whole trainer and the
whole engine at once, and the KV cache is sized from what the trainer left (`RunActors`).

With `cluster.off_policy_steps: 1` (disaggregated) the rollout of step k+1 is launched right
after step k's samples arrive (and the weights are pushed), so it runs on the engines while the
trainer trains on step k: the samples are at most one weight version old. Disaggregated, the
memory calls do nothing (the engines keep their devices); on CPU neither does the trainer's
offload (`RunActors`). `perf/idle_s` is the step's wall time outside every timed phase: the
controller's own overhead.

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

import torch
from tqdm import tqdm

from config_schema import to_plain
from miles_like.errors import RunFailed
from miles_like.recipe import Recipe, recipe_to_yaml
from miles_like.run import async_loop, bringup, checkpoint, rng_state
from miles_like.run.bringup import Run
from miles_like.run.busy import BusyAccounting
from miles_like.run.calls import ActorDied, CallTimeout
from miles_like.run.step import PhaseTimer, batch_with_advantages, controller_state, step_row
from miles_like.run.tracking import Tracker


def run(recipe: Recipe) -> int:
    out = Path(recipe.tracking.output_dir)
    resume = checkpoint.resolve_resume(recipe, log=tqdm.write)
    state = checkpoint.read_state(resume) if resume is not None else None
    if state is None and recipe.checkpoint.every_steps:
        checkpoint.refuse_earlier_run(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "recipe.yaml").write_text(recipe_to_yaml(recipe))
    with _stops_cleanly(out):
        started = bringup.start(recipe, log=tqdm.write, resume=resume, state=state)
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
        started.shutdown()
        raise
    if resume is not None:
        rng_state.restore(torch.load(resume / checkpoint.CONTROLLER_FILE, weights_only=True))
    if started.source.skipped:
        tqdm.write(f"data: skipped rows {started.source.skipped}")
    if first >= recipe.steps:
        tqdm.write(
            f"resume: the checkpoint is at step {first} of steps={recipe.steps}; nothing "
            "to do (raise steps to train further)"
        )
    failed = True
    try:
        with _stops_cleanly(out):
            steps = async_loop.steps if recipe.cluster.fully_async else _steps
            steps(recipe, started, tracker, out, first)
        failed = False
    finally:
        plot = tracker.finish()
        started.shutdown(graceful=not failed)
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


def _steps(recipe: Recipe, run: Run, tracker: Tracker, out: Path, first: int) -> None:
    """Steps `first` .. recipe.steps - 1."""
    actors, rollouts = run.actors, run.rollouts
    off_policy = recipe.cluster.off_policy_steps == 1
    every = recipe.checkpoint.every_steps
    pending = rollouts.launch(first) if first < recipe.steps else None
    busy = BusyAccounting(actors)
    for step in tqdm(
        range(first, recipe.steps), initial=first, total=recipe.steps, desc="RL steps", unit="step"
    ):
        timer, start, wall_start = PhaseTimer(), time.perf_counter(), time.time()
        more = step + 1 < recipe.steps
        sync_bytes = 0.0
        ckpt = checkpoint.begin(out, step + 1) if every and (step + 1) % every == 0 else None
        with timer("rollout"):
            rollout = rollouts.finish(pending)
            busy.rollout_finished(pending.started)
            pending = None
        if off_policy and more:  # the next rollout generates while this one trains
            if step > 0:  # the engines take the newest weights before their next rollout
                with timer("weight_sync"):
                    sync_bytes = actors.push_weights()
            else:  # every rollout starts from an empty prefix cache (as after a resume)
                actors.flush_prefix_caches()
            pending = rollouts.launch(step + 1)
        if off_policy and ckpt is not None:
            with timer("checkpoint"):  # the weights `pending` is generated with
                checkpoint.save_engine_weights(actors, ckpt)
        with timer("train"):  # the devices change hands before anything the trainer computes
            actors.release_engines()
            actors.onload_trainer()
        with timer("advantages"):
            batch, adv_metrics = batch_with_advantages(recipe, actors, rollout.groups)
        with timer("train"):
            train_metrics = actors.train(batch)
        if not off_policy:
            with timer("weight_sync"):
                actors.offload_trainer_optimizer()
                actors.resume_engine_weights()
                sync_bytes = actors.push_weights()
                actors.offload_trainer_weights()
                actors.alloc_engine_kv()
            if more:
                with timer("rollout"):
                    pending = rollouts.launch(step + 1)
        if ckpt is not None:
            with timer("checkpoint"):
                checkpoint.save_policy(actors, ckpt)
        row = step_row(
            step,
            timer,
            time.perf_counter() - start,
            rollout={**rollout.metrics, **adv_metrics, **actors.route_metrics()},
            train=train_metrics,
            sync_bytes=sync_bytes,
            sync_bytes_per_rank=actors.sync_bytes_per_rank,
        )
        # engines' and trainer's own compute intervals (after step_s: not part of the step)
        wall_end = wall_start + row["perf/step_s"]
        row.update(busy.step_done(wall_start, wall_end, pending and pending.started))
        if ckpt is not None:  # complete only now: the row is part of the checkpoint
            torch.save(rng_state.capture(), ckpt / checkpoint.CONTROLLER_FILE)
            state = _controller_state(run, tracker, step + 1, pending, row)
            checkpoint.finish(actors, ckpt, state)
        tracker.log(row)


def _controller_state(run: Run, tracker: Tracker, next_step: int, pending, row) -> dict:
    """state.json: where the loop stands before `next_step`. The data position is the one
    before the pending rollout drew its prompts: a resumed run draws them again."""
    consumed = pending.consumed_before if pending else run.source.consumed
    # over-sampling with retract: the partial groups the pending rollout continues
    carried = {"carried": run.rollouts.carry_state(pending)} if run.rollouts.streaming else {}
    return controller_state(run, tracker, next_step, consumed, row, **carried)

"""The fully asynchronous RL loop (`cluster.fully_async: true`, disaggregated), every phase
timed:

    take a batch from the buffer (waiting if none is ready) -> advantages
    -> train (meanwhile: take the next step's batch ahead) -> pause the engines (running
    requests aborted, tokens kept) -> weight sync -> drop what is now too stale
    -> [checkpoint] -> resume the engines -> log

At max_staleness >= 1 the next step's batch is taken while the train call runs, for the
version that call produces (`AsyncProducer.take_ahead`; given up, nothing taken, if the call
finishes first or an engine is dead), so that the next call starts right after the update;
not in a step that checkpoints (the checkpoint's producer state holds every untrained group).

The engines generate all along (`async_rollouts.AsyncProducer`): while the trainer trains,
they finish the groups left open and (below the buffer's capacity) start new ones. The weight
update is the only moment they stop, for the abort + broadcast; the groups they were computing
continue right after it under the new weights.

With `rollout.partial: in_place` the update does not stop them at all (running requests keep
their K/V and sample on under the new weights), except before a checkpoint, where it aborts
them as retract does (their K/V parked) so that the checkpoint holds every open group's tokens.

With `cluster.max_staleness: 0` the capacity is one batch, generated only with the current
weights: every step draws prompts_per_step prompts, generates them in one wave seeded as the
synchronous loop seeds them, trains on all of them in data order and syncs, which is the
synchronous disaggregated run (`off_policy_steps: 0`), every metric but the timings.

Checkpoints are taken after the weight update and the staleness drop, before the engines
resume: nothing runs, so the open groups (with their tokens, log-probs and versions), the
buffer and the data position in state.json (`async`) are exactly what the resumed producer
starts from; the step's metrics row goes into the checkpoint before it is marked complete.
The rows carry `rollout/trained_prompt_ids`, `rollout/stale_dropped_prompt_ids`,
`rollout/aborted_prompt_ids`, `rollout/dynamic_filtered_prompt_ids` (dynamic sampling), and
after the step `rollout/held_prompt_ids` (open, buffered, taken ahead, filtered but not yet
reported) and `rollout/data_consumed`: over a run's rows, trained + dropped + aborted + filtered
+ held = every drawn index, once.

Fully asynchronous training is disaggregated (the recipe refuses it colocated): the engines keep
their devices, so the step has no memory phases (`RunActors.release_engines` and the others would
do nothing).

`perf/`: the rollout window of the busy accounting is the step itself (the engines generate
through every phase), so `perf/engine_busy_frac` is the share of the step's wall time the
engines spend in forward passes, and `perf/device_idle_frac` the share in which neither they
nor the trainer compute.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch
from tqdm import tqdm

from miles_like.recipe import Recipe
from miles_like.rollouts.async_producer import AsyncProducer, batch_metrics
from miles_like.run import checkpoint, rng_state
from miles_like.run.busy import BusyAccounting
from miles_like.run.step import (
    PhaseTimer,
    advantages_ask_trainer,
    batch_with_advantages,
    controller_state,
    step_row,
)
from miles_like.run.tracking import Tracker


def steps(recipe: Recipe, run, tracker: Tracker, out: Path, first: int) -> None:
    """Steps `first` .. recipe.steps - 1 of a `bringup.Run` (`loop.run`'s for fully_async)."""
    if first >= recipe.steps:
        return
    actors = run.actors
    every = recipe.checkpoint.every_steps
    capacity = recipe.async_buffer_groups
    producer = AsyncProducer(run.rollouts, capacity, recipe.cluster.max_staleness)
    producer.start(actors.weight_version, run.resumed.get("async") if run.resumed else None)
    busy = BusyAccounting(actors)
    in_place = recipe.rollout.partial == "in_place"
    # the next step's batch, taken while this one trains (`take_ahead`); at max_staleness 0
    # the next batch is generated only after the update
    can_take_ahead = recipe.cluster.take_ahead and recipe.cluster.max_staleness > 0
    ahead = None
    per_step = recipe.rollout.prompts_per_step
    for step in tqdm(
        range(first, recipe.steps), initial=first, total=recipe.steps, desc="RL steps", unit="step"
    ):
        timer, start, wall_start = PhaseTimer(), time.perf_counter(), time.time()
        # the pieces of the weight update and the controller's own work (perf/async_*_s)
        subphases = PhaseTimer()
        ckpt = checkpoint.begin(out, step + 1) if every and (step + 1) % every == 0 else None
        trained_version, restarts = actors.weight_version, actors.engine_restarts
        taken_ahead = ahead is not None
        with timer("rollout"):  # waiting for a batch: the trainer's idle time
            taken, prepared = ahead or (producer.take(per_step, trained_version), None)
        with timer("advantages"):
            batch, adv_metrics = prepared or batch_with_advantages(recipe, actors, taken.groups)
        with timer("train"):
            calls = actors.start_train(batch)
            # not before a checkpoint: its producer state must hold every untrained group
            ahead = None
            if can_take_ahead and ckpt is None and step + 1 < recipe.steps:
                with subphases("take_ahead"):
                    ahead = _take_ahead(recipe, actors, producer, trained_version + 1, calls[0].ref)
            train_metrics = actors.finish_train(calls)
        with timer("weight_sync"):
            # in_place: requests run on through the update, except before a checkpoint, which
            # needs every open group's tokens (their K/V is parked for the continuation)
            keep_running = in_place and ckpt is None
            with subphases("pause"):
                producer.pause(abort=not keep_running)
            with subphases("broadcast"):
                sync_bytes = actors.push_weights(in_place=keep_running)
            with subphases("drop_stale"):
                producer.drop_stale(actors.weight_version)
        if ckpt is not None:
            with timer("checkpoint"):
                checkpoint.save_policy(actors, ckpt)
                async_state = producer.state()
                consumed = run.source.consumed
        if step + 1 < recipe.steps:
            with timer("weight_sync"), subphases("resume"):
                producer.resume()
        with subphases("accounting"):
            stale, aborted, held = producer.drops()
            rollout = {
                **run.rollouts.async_rollout(taken),
                **batch_metrics(taken, stale, aborted, capacity),
                # the oldest weight version of each trained group's tokens
                "trained_prompt_versions": [trained_version - s for s in taken.staleness],
                "held_prompt_ids": held,
                "taken_ahead": float(taken_ahead),
                "engine_restarts": actors.engine_restarts - restarts,
                "data_consumed": run.source.consumed,
                **adv_metrics,
                **actors.route_metrics(),
            }
        row = step_row(
            step,
            timer,
            time.perf_counter() - start,
            rollout=rollout,
            train=train_metrics,
            sync_bytes=sync_bytes,
            sync_bytes_per_rank=actors.sync_bytes_per_rank,
        )
        busy.rollout_finished(start)  # the engines' window is the whole step
        with subphases("busy"):  # after the step's window: not in step_s
            row.update(busy.step_done(wall_start, wall_start + row["perf/step_s"], None))
        row.update({f"perf/async_{k}_s": v for k, v in subphases.seconds.items()})
        if ckpt is not None:
            torch.save(rng_state.capture(), ckpt / checkpoint.CONTROLLER_FILE)
            # the data position is the one the producer's state was taken at: every drawn prompt
            # is trained, dropped, or in `async`
            saved = {"async": async_state}
            state = controller_state(run, tracker, step + 1, consumed, row, **saved)
            checkpoint.finish(actors, ckpt, state)
        tracker.log(row)


def _take_ahead(recipe: Recipe, actors, producer: AsyncProducer, version: int, training):
    """(the next step's batch for trainer `version`, with its advantages where they need no
    trainer call: GRPO-like) taken while `training` runs, or None (`AsyncProducer.take_ahead`)."""
    taken = producer.take_ahead(recipe.rollout.prompts_per_step, version, training)
    if taken is None:
        return None
    if advantages_ask_trainer(recipe):  # the trainer is busy: they are computed in the step
        return taken, None
    return taken, batch_with_advantages(recipe, actors, taken.groups)

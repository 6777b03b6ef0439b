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
from miles_like.run.runtime import Runtime
from miles_like.run.tracking import Tracker


def steps(recipe: Recipe, rt: Runtime, tracker: Tracker, out: Path, first: int) -> None:
    """Steps `first` .. recipe.steps - 1 (the caller's `loop._steps` for fully_async)."""
    from miles_like.run.loop import PhaseTimer, batch_with_advantages, controller_state

    if first >= recipe.steps:
        return
    every = recipe.checkpoint.every_steps
    capacity = recipe.async_buffer_groups
    producer = AsyncProducer(rt.rollouts, capacity, recipe.cluster.max_staleness)
    state = rt.state.get("async") if rt.state else None
    producer.start(rt.weight_version, state)
    busy = BusyAccounting(rt)
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
        parts = PhaseTimer()  # the weight update's and the controller's pieces (perf/async_*)
        ckpt = checkpoint.begin(out, step + 1) if every and (step + 1) % every == 0 else None
        trained_version, restarts = rt.weight_version, rt.engine_restarts
        taken_ahead = ahead is not None
        with timer("rollout"):  # waiting for a batch: the trainer's idle time
            taken, prepared = ahead or (producer.take(per_step, trained_version), None)
        with timer("advantages"):
            batch, adv_metrics = prepared or batch_with_advantages(recipe, rt, taken.groups)
        with timer("train"):
            calls = rt.start_train(batch)
            # not before a checkpoint: its producer state must hold every untrained group
            ahead = None
            if can_take_ahead and ckpt is None and step + 1 < recipe.steps:
                with parts("take_ahead"):
                    ahead = _take_ahead(recipe, rt, producer, trained_version + 1, calls[0].ref)
            train_metrics = rt.finish_train(calls)
        with timer("weight_sync"):
            # in_place: requests run on through the update, except before a checkpoint, which
            # needs every open group's tokens (their K/V is parked for the continuation)
            keep_running = in_place and ckpt is None
            with parts("pause"):
                producer.pause(abort=not keep_running)
            with parts("broadcast"):
                sync_bytes = rt.sync_weights(in_place=keep_running)
            with parts("drop_stale"):
                producer.drop_stale(rt.weight_version)
        if ckpt is not None:
            with timer("checkpoint"):
                rt.save_checkpoint(ckpt)
                async_state = producer.state()
                consumed = rt.source.consumed
        if step + 1 < recipe.steps:
            with timer("weight_sync"), parts("resume"):
                producer.resume()
        with parts("accounting"):
            stale, aborted, held = producer.drops()
            rollout = rt.rollouts.async_rollout(taken)
        step_s = time.perf_counter() - start
        row = {
            "step": step,
            **{f"rollout/{k}": v for k, v in rollout.items()},
            **{
                f"rollout/{k}": v for k, v in batch_metrics(taken, stale, aborted, capacity).items()
            },
            # the oldest weight version of each trained group's tokens
            "rollout/trained_prompt_versions": [trained_version - s for s in taken.staleness],
            "rollout/held_prompt_ids": held,
            "rollout/taken_ahead": float(taken_ahead),
            "rollout/engine_restarts": rt.engine_restarts - restarts,
            "rollout/data_consumed": rt.source.consumed,
            **{f"rollout/{k}": v for k, v in adv_metrics.items()},
            **{f"train/{k}": v for k, v in train_metrics.items()},
            **{f"perf/{k}_s": v for k, v in timer.seconds.items()},
            "perf/step_s": step_s,
            "perf/weight_sync_bytes": sync_bytes,
            "perf/weight_sync_bytes_per_rank": rt.sync_bytes_per_rank if sync_bytes else 0.0,
        }
        row["perf/idle_s"] = max(0.0, step_s - sum(timer.seconds.values()))
        row["perf/idle_frac"] = row["perf/idle_s"] / step_s
        busy.rollout_finished(start)  # the engines' window is the whole step
        with parts("busy"):  # after the step's window: not in step_s
            row.update(busy.step_done(wall_start, wall_start + step_s, None))
        row.update({f"perf/async_{k}_s": v for k, v in parts.seconds.items()})
        if ckpt is not None:
            torch.save(rng_state.capture(), ckpt / checkpoint.CONTROLLER_FILE)
            # the data position is the one the producer's state was taken at: every drawn prompt
            # is trained, dropped, or in `async`
            saved = {"async": async_state}
            rt.commit_checkpoint(
                ckpt, controller_state(rt, tracker, step + 1, consumed, row, **saved)
            )
        tracker.log(row)


def _take_ahead(recipe: Recipe, rt: Runtime, producer: AsyncProducer, version: int, training):
    """(the next step's batch for trainer `version`, with its advantages where they need no
    trainer call: GRPO-like) taken while `training` runs, or None (`AsyncProducer.take_ahead`)."""
    from miles_like.run.loop import advantages_ask_trainer, batch_with_advantages

    taken = producer.take_ahead(recipe.rollout.prompts_per_step, version, training)
    if taken is None:
        return None
    if advantages_ask_trainer(recipe):  # the trainer is busy: they are computed in the step
        return taken, None
    return taken, batch_with_advantages(recipe, rt, taken.groups)

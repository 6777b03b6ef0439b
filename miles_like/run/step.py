"""What both loops (`loop.py`, `async_loop.py`) do in a step besides their choreography: time its
phases, turn its groups into the trainer's batch with advantages, build its metrics row, and
write where it stands into a checkpoint's state.json.
"""

from __future__ import annotations

import dataclasses
import time
from contextlib import contextmanager

import ray

from miles_like.run.tracking import json_row
from miles_like.scoring.batch import samples_batch, with_advantages


class PhaseTimer:
    """Seconds per phase; a phase timed twice in a step adds up."""

    def __init__(self):
        self.seconds: dict[str, float] = {}

    @contextmanager
    def __call__(self, phase: str):
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[phase] = self.seconds.get(phase, 0.0) + time.perf_counter() - start


def advantages_ask_trainer(recipe) -> bool:
    """Whether `batch_with_advantages` calls the trainer (the critic's values, the reference's
    log-probs): then the trainer must be onloaded and not busy."""
    return recipe.algorithm.advantage == "gae" or recipe.algorithm.kl_reward_coef > 0


def batch_with_advantages(recipe, actors, groups) -> tuple:
    """The trainer's batch of `groups` with its advantages (and their metrics), asking the
    critic for values (GAE) and the reference model for log-probs (KL in the reward) where the
    algorithm needs them (`actors`: the run's `RunActors`, its trainer onloaded)."""
    batch = samples_batch(groups)
    gae, kl = recipe.algorithm.advantage == "gae", recipe.algorithm.kl_reward_coef > 0
    # one copy for both calls, none without them; neither replays routes
    plain = dataclasses.replace(batch, routed_experts=None)
    ref = ray.put(plain) if gae or kl else None
    values = actors.values(ref) if gae else None
    ref_lp = actors.ref_logprobs(ref) if kl else None
    return with_advantages(batch, groups, recipe.algorithm, values=values, ref_logprobs=ref_lp)


def step_row(
    step: int,
    timer: PhaseTimer,
    step_s: float,
    *,
    rollout: dict,
    train: dict,
    sync_bytes: float,
    sync_bytes_per_rank: float,
) -> dict:
    """A step's metrics row: `rollout/` and `train/` metrics, each phase's seconds, the step's,
    the weight push's bytes, and `perf/idle_s`: the step's wall time outside every timed phase
    (the controller's own overhead; an untimed phase would show up here)."""
    row = {
        "step": step,
        **{f"rollout/{k}": v for k, v in rollout.items()},
        **{f"train/{k}": v for k, v in train.items()},
        **{f"perf/{k}_s": v for k, v in timer.seconds.items()},
        "perf/step_s": step_s,
        "perf/weight_sync_bytes": sync_bytes,
        # the most one trainer rank sent (resharding sync: its own shards only)
        "perf/weight_sync_bytes_per_rank": sync_bytes_per_rank if sync_bytes else 0.0,
    }
    row.setdefault("perf/weight_sync_s", 0.0)
    row["perf/idle_s"] = max(0.0, step_s - sum(timer.seconds.values()))
    row["perf/idle_frac"] = row["perf/idle_s"] / step_s
    return row


def controller_state(run, tracker, next_step: int, consumed: int, row, **rollout_state) -> dict:
    """state.json of either loop (`run`: the `bringup.Run`): the step, the data position
    `consumed`, the weights' version, the layout, the last metrics row, and what the loop's
    rollouts carry (`rollout_state`)."""
    return {
        "next_step": next_step,
        "data_consumed": consumed,
        "data_epoch": run.source.epoch_at(consumed),
        "weight_version": run.actors.weight_version,
        "wandb_run_id": tracker.wandb_run_id,
        **run.layout_state(),
        "last_row": json_row(row),
        **rollout_state,
    }

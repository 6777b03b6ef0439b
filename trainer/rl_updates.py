"""The policy's part of one RL step: several optimizer updates on one rollout's batch.

The batch is split into consecutive mini-batches, one optimizer step each. Every update's old
log-probs are the weights' *before the first update* of the rollout:

* the first mini-batch takes them from its own training forward (`objective`: ratio
  exp(lp - sg[lp]) exactly 1, PPO-KL exactly 0), so an on-policy step with one update runs no
  scoring pass;
* the later mini-batches are scored before the first update, mini-batch by mini-batch, so each
  update packs exactly the micro-batches its old log-probs came from (where a matmul's rounding
  depends on its row count, as float64 on CPU does, that keeps a ratio bitwise 1 on unchanged
  weights);
* off policy the whole batch is scored first: the lag metrics and the kept copy of the sampling
  weights (`keep_sampling_weights`) are taken before any update.

The reference's log-probs (a KL term) are scored first. The mismatch metrics
(`trainer.mismatch`) compare the engine's log-probs with the trainer's before any update, over
the whole batch; the others are averaged over the updates (`ratio_max`: the max).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from trainer import objective
from trainer.config import RLBatch
from trainer.mismatch import MISMATCH_KEYS, lag_metrics, mismatch_metrics


def train_policy(
    policy, batch: RLBatch, minis: Sequence[Sequence[int]], off_policy: bool
) -> dict[str, float]:
    """`policy` is a MegatronTrainer or DeepSpeedTrainer (every rank calls this together);
    `minis` the mini-batches' sample indices, in update order."""
    loss = policy.cfg.loss
    batch = objective.complete_batch(batch, loss, policy.compute_ref_logprobs)
    needs_old = objective.old_from_forward(batch, loss)
    fuse_first = needs_old and not off_policy
    old = list(batch.old_logprobs) if batch.old_logprobs is not None else [None] * len(batch.tokens)
    if needs_old:
        for idx in minis[1:] if fuse_first else minis:
            for i, lp in zip(idx, policy.compute_logprobs(batch.subset(list(idx)))):
                old[i] = lp
    per_update: list[dict[str, float]] = []
    if fuse_first:
        first = policy.train_step_scored(batch.subset(list(minis[0])))
        per_update.append(first.metrics)
        for i, lp in zip(minis[0], first.old_logprobs):
            old[i] = lp
    if all(t is not None for t in old):
        batch = dataclasses.replace(batch, old_logprobs=old)
    metrics = mismatch_metrics(batch, loss)
    if off_policy:
        # the copy holds the weights this batch was sampled with (taken before the last
        # update, right after they were synced); from now on the engines sample with these
        if policy.sampling is not None:
            metrics.update(lag_metrics(batch, policy.compute_sampling_logprobs(batch)))
        policy.keep_sampling_weights()
    for idx in minis[len(per_update) :]:
        per_update.append(policy.train_step(batch.subset(list(idx))))
    for key in per_update[0]:
        if key in MISMATCH_KEYS:
            continue
        values = [m[key] for m in per_update]
        metrics[key] = max(values) if key == "ratio_max" else sum(values) / len(values)
    # The first mini-batch trains on the weights its old log-probs came from: its PPO-KL is
    # exactly 0 (a check that engine samples, old log-probs and the update line up).
    if "ppo_kl" in per_update[0]:
        metrics["ppo_kl_first_update"] = per_update[0]["ppo_kl"]
    return metrics

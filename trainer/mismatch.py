"""How far the engine's log-probs are from the trainer's, on the tokens the loss trains on.

Both sides score the same sampled tokens: the engine while sampling them, the trainer before
the update (its old log-probs). With log r = trainer - engine per token, over loss-masked
response tokens (a multi-turn trajectory masks its tool tokens):

* logprob_diff_max / _mean: |log r| (DESIGN's train/logprob_diff_*);
* logprob_diff_large_frac: the share of tokens with |log r| > 0.1;
* logprob_diff_seq_mean_max: the largest per-sequence mean of |log r|;
* mismatch_kl: the k3 estimate of KL(engine || trainer), mean of r - 1 - log r (>= 0; the
  samples come from the engine);
* is_weight_mean: the mean importance weight the loss applies, w = r truncated (tis: min(w,
  cap)) or masked (mis: 0 outside [floor, cap]); the raw r without a correction;
* is_clipped_frac: the share of tokens whose weight the correction truncated or dropped.

Off policy (disaggregated, `cluster.off_policy_steps: 1`) the engine sampled with the weights of
one version before the trainer's, so these compare the engine with the trainer's *current*
weights: the precision mismatch plus the policy lag. Where both sides hold the same weights
(every colocated step, a disaggregated run's first step) they are the mismatch alone.
`lag_metrics` separates the two, given the trainer's log-probs under the engine's weights (the
trainer keeps a copy of them: `keep_sampling_weights`). A step whose rollout a replacement engine
finished (`rollout/engine_restarts`) was sampled partly with the trainer's current weights,
which the copy does not know: its split is off for that step.
"""

from __future__ import annotations

import dataclasses

import torch

from trainer import losses
from trainer.config import LossConfig, RLBatch

MISMATCH_KEYS = (
    "logprob_diff_max",
    "logprob_diff_mean",
    "logprob_diff_large_frac",
    "logprob_diff_seq_mean_max",
    "mismatch_kl",
    "is_weight_mean",
    "is_clipped_frac",
)


def mismatch_metrics(batch: RLBatch, loss: LossConfig) -> dict[str, float]:
    """The metrics above for `batch` (old log-probs from the trainer, rollout log-probs from the
    engine). Empty when the batch lacks either side or has no loss-masked token."""
    if batch.rollout_logprobs is None or batch.old_logprobs is None:
        return {}
    old, engine, masks, seq_means = [], [], [], []
    for i in range(len(batch.tokens)):
        old.append(batch.old_logprobs[i].double().cpu())
        engine.append(batch.rollout_logprobs[i].double().cpu())
        masks.append(
            torch.ones_like(old[-1])
            if batch.loss_masks is None
            else batch.loss_masks[i].double().cpu()
        )
        if bool((masks[-1] > 0).any()):
            seq_means.append(
                float(((old[-1] - engine[-1]).abs() * masks[-1]).sum() / masks[-1].sum())
            )
    if not seq_means:
        return {}
    old, engine, mask = torch.cat(old), torch.cat(engine), torch.cat(masks)
    log_r = old - engine
    on = mask > 0
    count = mask.sum()

    def mean(values: torch.Tensor) -> float:
        return float((values * mask).sum() / count)

    diff = log_r.abs()
    w = log_r.exp()
    if loss.is_correction is None:
        applied, clipped = w, torch.zeros_like(w)
    else:
        applied = losses.importance_weights(
            old, engine, mode=loss.is_correction, cap=loss.is_cap, floor=loss.is_floor
        )
        clipped = (applied != w).double()
    return {
        "logprob_diff_max": float(diff[on].max()),
        "logprob_diff_mean": mean(diff),
        "logprob_diff_large_frac": mean((diff > 0.1).double()),
        "logprob_diff_seq_mean_max": max(seq_means),
        "mismatch_kl": mean(w - 1.0 - log_r),
        "is_weight_mean": mean(applied),
        "is_clipped_frac": mean(clipped),
    }


def lag_metrics(batch: RLBatch, sampling_logprobs: list[torch.Tensor]) -> dict[str, float]:
    """Off policy, from the trainer's log-probs under the weights the engine sampled with
    (`sampling_logprobs`) and its current ones (`batch.old_logprobs`), over loss-masked tokens:

    * mismatch_kl_same_weights, logprob_diff_max_same_weights: engine vs trainer on the same
      weights, the precision mismatch alone;
    * policy_lag_kl: k3 of KL(sampling weights || current weights) on the engine's samples."""
    same = mismatch_metrics(
        dataclasses.replace(batch, old_logprobs=sampling_logprobs), LossConfig()
    )
    lag = mismatch_metrics(
        dataclasses.replace(batch, rollout_logprobs=sampling_logprobs), LossConfig()
    )
    if not same or not lag:
        return {}
    return {
        "mismatch_kl_same_weights": same["mismatch_kl"],
        "logprob_diff_max_same_weights": same["logprob_diff_max"],
        "policy_lag_kl": lag["mismatch_kl"],
    }

"""The training objective of one micro-batch, shared by the megatron and DeepSpeed backends.

Given the response tokens' log-probs and entropy under the current policy, and the batch's
per-token data (advantages, old / reference / engine log-probs, masks) in the same packed
order, compute this micro-batch's *share* of the global loss: every aggregate is normalized by
the whole batch's token / sequence counts, so summing the shares over micro-batches and
data-parallel ranks gives exactly the batch loss, and its gradient.

Metrics are returned the same way (sums of shares), except `ratio_max` (a max).

Old log-probs: a batch without them is trained on-policy from the weights it is trained with,
so the update's own forward supplies them: old = logprobs.detach(), ratio = exp(lp - sg[lp])
(value exactly 1, gradient that of lp) and PPO-KL exactly 0, with no separate scoring pass.
Where the old policy differs from the weights being trained (a later mini-batch of the same
rollout, a later update) the caller scores them beforehand and passes them in.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import torch

from trainer import losses
from trainer.config import LossConfig, RLBatch
from trainer.packing import MicroBatch


class Normalizers(NamedTuple):
    tokens: float  # loss-masked response tokens in the whole batch
    seqs: float  # sequences in the whole batch


class ScoredStep(NamedTuple):
    """A train step's metrics and, when the step took its old log-probs from its own forward,
    those log-probs (one tensor per sample of the batch, on the host; else None)."""

    metrics: dict[str, float]
    old_logprobs: list[torch.Tensor] | None


class TokenData(NamedTuple):
    """Per response token of one micro-batch, in packed order (sample by sample)."""

    seq_ids: torch.Tensor  # [n] long, 0-based within the micro-batch
    mask: torch.Tensor  # [n] float
    advantages: torch.Tensor | None
    old_logprobs: torch.Tensor | None
    ref_logprobs: torch.Tensor | None
    rollout_logprobs: torch.Tensor | None


# Metric names every backend reports; all are token means over the batch except loss / pg_loss
# (the aggregated objective terms), ratio_max (a max), and grad_norm / lr (set by the step).
# `ppo_kl` is the k1 estimate of KL(old || current) over the response tokens: exactly 0 on the
# first update of a rollout, whose old log-probs are the update's own forward's.
METRIC_KEYS = ("loss", "pg_loss", "kl", "ppo_kl", "entropy", "clipfrac", "ratio_mean", "ratio_max")


def complete_batch(batch: RLBatch, loss: LossConfig, compute_ref_logprobs) -> RLBatch:
    """Fill in the reference's log-probs when a KL term needs them and the caller did not give
    them. (Missing old log-probs are not scored here: the update's forward supplies them.)"""
    if loss.kl_coef > 0 and batch.ref_logprobs is None:
        batch = dataclasses.replace(batch, ref_logprobs=compute_ref_logprobs(batch))
    return batch


def old_from_forward(batch: RLBatch, loss: LossConfig) -> bool:
    """Whether this step takes its old log-probs from its own forward (see the module doc)."""
    return loss.policy_loss != "sft" and batch.old_logprobs is None


def split_by_sample(values: torch.Tensor, batch: RLBatch, mb: MicroBatch, index) -> dict:
    """{index[i]: this sample's slice of `values` (detached, host)} for the samples i of `mb`
    (indices into `batch`); `values` holds their response tokens in packed order."""
    lengths = [batch.response_len(i) for i in mb.sample_indices]
    parts = values.detach().cpu().split(lengths)
    return {index[i]: t for i, t in zip(mb.sample_indices, parts)}


def normalizers(batch: RLBatch) -> Normalizers:
    if batch.loss_masks is None:
        tokens = sum(batch.response_len(i) for i in range(len(batch.tokens)))
    else:
        tokens = float(sum(m.float().sum() for m in batch.loss_masks))
    return Normalizers(float(tokens), float(len(batch.tokens)))


def token_data(batch: RLBatch, mb: MicroBatch, device: torch.device) -> TokenData:
    idx = mb.sample_indices

    def cat(values):
        if values is None:
            return None
        # float32 at least; float64 (a float64 model's log-probs) stays float64, so the first
        # update's ratio is exactly 1 whatever the dtype
        return torch.cat([values[i].reshape(-1) for i in idx]).to(
            device, torch.promote_types(values[idx[0]].dtype, torch.float32)
        )

    lengths = torch.tensor([batch.response_len(i) for i in idx])
    seq_ids = torch.repeat_interleave(torch.arange(len(idx)), lengths).to(device)
    mask = cat(batch.loss_masks)
    if mask is None:
        mask = torch.ones(int(lengths.sum()), device=device)
    return TokenData(
        seq_ids,
        mask,
        cat(batch.advantages),
        cat(batch.old_logprobs),
        cat(batch.ref_logprobs),
        cat(batch.rollout_logprobs),
    )


def micro_batch_objective(
    logprobs: torch.Tensor,
    entropy: torch.Tensor,
    data: TokenData,
    cfg: LossConfig,
    norm: Normalizers,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """(loss share with grad, metric shares detached) for one micro-batch's response tokens."""

    def agg(values):
        return losses.aggregate(
            values,
            data.mask,
            data.seq_ids,
            cfg.loss_agg,
            total_tokens=norm.tokens,
            total_seqs=norm.seqs,
        )

    def token_mean(values):
        return (values.detach() * data.mask).sum() / max(norm.tokens, 1.0)

    if cfg.policy_loss == "sft":
        per_token = losses.sft_loss(logprobs)
        ratio = torch.ones_like(logprobs)
        clipped = torch.zeros_like(logprobs)
        ppo_kl = torch.zeros((), device=logprobs.device)
    else:
        if data.advantages is None:
            raise ValueError(f"policy_loss={cfg.policy_loss!r} needs batch.advantages")
        # on-policy first update: the old policy is these very weights (module doc)
        old = logprobs.detach() if data.old_logprobs is None else data.old_logprobs
        if cfg.policy_loss == "ppo":
            out = losses.ppo_policy_loss(
                logprobs,
                old,
                data.advantages,
                clip_low=cfg.clip_low,
                clip_high=cfg.clip_high,
                dual_clip=cfg.dual_clip,
            )
        else:
            out = losses.gspo_policy_loss(
                logprobs,
                old,
                data.advantages,
                data.mask,
                data.seq_ids,
                clip_low=cfg.clip_low,
                clip_high=cfg.clip_high,
            )
        per_token, ratio, clipped = out
        ppo_kl = token_mean(old - logprobs)
        if cfg.is_correction is not None:
            if data.rollout_logprobs is None:
                raise ValueError(
                    f"trainer.loss.is_correction={cfg.is_correction!r} needs "
                    "batch.rollout_logprobs (the engine's log-probs)"
                )
            per_token = per_token * losses.importance_weights(
                old,
                data.rollout_logprobs,
                mode=cfg.is_correction,
                cap=cfg.is_cap,
                floor=cfg.is_floor,
            )

    pg_loss = agg(per_token)
    loss = pg_loss
    kl = torch.zeros((), device=logprobs.device)
    if cfg.kl_coef > 0:
        if data.ref_logprobs is None:
            raise ValueError("trainer.loss.kl_coef > 0 needs reference log-probs")
        kl_tok = losses.kl_divergence(logprobs, data.ref_logprobs, cfg.kl_type)
        loss = loss + cfg.kl_coef * agg(kl_tok)
        kl = token_mean(kl_tok)
    if cfg.entropy_coef:
        loss = loss - cfg.entropy_coef * agg(entropy)

    # ratios are positive, so 0 outside the mask leaves the max of the masked ones (0 when
    # none is), computed without reading the mask back to the host
    masked_ratio = torch.where(data.mask > 0, ratio.detach(), 0.0)
    metrics = {
        "loss": loss.detach(),
        "pg_loss": pg_loss.detach(),
        "kl": kl,
        "ppo_kl": ppo_kl,
        "entropy": token_mean(entropy),
        "clipfrac": token_mean(clipped),
        "ratio_mean": token_mean(ratio),
        "ratio_max": masked_ratio.amax() if masked_ratio.numel() else masked_ratio.sum(),
    }
    return loss, metrics

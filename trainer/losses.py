"""RL and SFT losses as pure functions of per-token tensors.

Conventions: every per-token tensor is flat, shape [n], holding the response tokens of several
sequences back to back; `seq_ids` [n] (long, non-decreasing from 0) says which sequence each
token belongs to and `mask` [n] (float or bool) which tokens count. Functions return per-token
values; `aggregate` turns them into a scalar.

Aggregation takes explicit normalizers so that a loss split over micro-batches and data-parallel
ranks sums to exactly the loss of the whole batch: pass the *global* token / sequence counts,
and sum the per-micro-batch results.
"""

from __future__ import annotations

import typing
from typing import Literal, NamedTuple

import torch

LossAgg = Literal["token-mean", "seq-mean", "seq-mean-token-sum"]
KLType = Literal["k1", "k2", "k3", "low-var-kl"]
LOSS_AGGS = typing.get_args(LossAgg)
KL_TYPES = typing.get_args(KLType)


def _seq_sums(values: torch.Tensor, seq_ids: torch.Tensor, num_seqs: int) -> torch.Tensor:
    return torch.zeros(num_seqs, dtype=values.dtype, device=values.device).index_add(
        0, seq_ids, values
    )


def aggregate(
    values: torch.Tensor,
    mask: torch.Tensor,
    seq_ids: torch.Tensor,
    mode: LossAgg,
    *,
    total_tokens: float | None = None,
    total_seqs: float | None = None,
) -> torch.Tensor:
    """Reduce per-token `values` to a scalar.

    * token-mean:          sum_tokens(v) / total_tokens
    * seq-mean:            sum_seqs(mean_tokens_of_seq(v)) / total_seqs
    * seq-mean-token-sum:  sum_seqs(sum_tokens_of_seq(v)) / total_seqs   (Dr.GRPO: no length
                           normalization per sequence, so long answers are not favoured)

    `total_tokens` / `total_seqs` default to this call's own counts (masked tokens; sequences
    present in `seq_ids`)."""
    if mode not in LOSS_AGGS:
        raise ValueError(f"loss_agg={mode!r}; expected one of {LOSS_AGGS}")
    mask = mask.to(values.dtype)
    v = values * mask
    if mode == "token-mean":
        denom = mask.sum() if total_tokens is None else total_tokens
        return v.sum() / max(float(denom), 1.0)
    # read from the device only where a mode needs it (a host synchronisation)
    local_seqs = int(seq_ids.max()) + 1 if seq_ids.numel() else 0
    seqs = local_seqs if total_seqs is None else total_seqs
    if mode == "seq-mean-token-sum":
        return v.sum() / max(float(seqs), 1.0)
    per_seq = _seq_sums(v, seq_ids, local_seqs)
    lens = _seq_sums(mask, seq_ids, local_seqs)
    return (per_seq / lens.clamp(min=1.0)).sum() / max(float(seqs), 1.0)


class PolicyLoss(NamedTuple):
    loss: torch.Tensor  # [n] per-token loss
    ratio: torch.Tensor  # [n] importance ratio pi / pi_old (detached)
    clipped: torch.Tensor  # [n] float: 1 where the clipped branch was taken


def _clipped_surrogate(
    ratio: torch.Tensor,
    advantages: torch.Tensor,
    clip_low: float,
    clip_high: float,
    dual_clip: float | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    loss = torch.maximum(unclipped, clipped)
    took_clip = (clipped > unclipped).to(ratio.dtype)
    if dual_clip is not None:
        if dual_clip <= 1.0:
            raise ValueError(f"dual_clip={dual_clip} must be > 1 (Ye et al. 2020 use 3)")
        # For negative advantages bound the loss by -c * A, so a huge ratio cannot blow it up.
        bound = -advantages * dual_clip
        dual = torch.minimum(loss, bound)
        took_clip = torch.where(
            (advantages < 0) & (bound < loss), torch.ones_like(took_clip), took_clip
        )
        loss = torch.where(advantages < 0, dual, loss)
    return loss, took_clip


def ppo_policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    dual_clip: float | None = None,
) -> PolicyLoss:
    """PPO clipped surrogate, per token: max(-A r, -A clip(r, 1 - clip_low, 1 + clip_high)).

    clip_high > clip_low is DAPO's clip-higher. With `dual_clip` = c, tokens with A < 0 take
    min(that, -c A)."""
    ratio = torch.exp(logprobs - old_logprobs)
    loss, took_clip = _clipped_surrogate(ratio, advantages, clip_low, clip_high, dual_clip)
    return PolicyLoss(loss, ratio.detach(), took_clip)


def gspo_policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    seq_ids: torch.Tensor,
    *,
    clip_low: float = 3e-4,
    clip_high: float = 4e-4,
) -> PolicyLoss:
    """GSPO: one importance ratio per sequence, s_i = exp(mean over its tokens of log r).

    Token form (GSPO-token): s_i,t = sg[s_i] * exp(logp_t - sg[logp_t]), whose value is s_i and
    whose gradient is s_i * grad logp_t; with per-token advantages equal to the sequence's, the
    seq-mean aggregate of this loss is exactly the GSPO objective."""
    m = mask.to(logprobs.dtype)
    num_seqs = int(seq_ids.max()) + 1 if seq_ids.numel() else 0
    log_r = (logprobs - old_logprobs) * m
    seq_log_r = _seq_sums(log_r, seq_ids, num_seqs) / _seq_sums(m, seq_ids, num_seqs).clamp(min=1.0)
    s = torch.exp(seq_log_r.detach()[seq_ids] + logprobs - logprobs.detach())
    loss, took_clip = _clipped_surrogate(s, advantages, clip_low, clip_high, None)
    return PolicyLoss(loss, s.detach(), took_clip)


def kl_divergence(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, kind: KLType) -> torch.Tensor:
    """Per-token estimate of KL(pi || pi_ref) from samples of pi (Schulman's k1/k2/k3).

    k1 = log r, k2 = (log r)^2 / 2, k3 = exp(-log r) - 1 + log r with log r = logp - ref_logp;
    low-var-kl is k3 clamped to [-10, 10] (as in verl), robust to rare huge ratios."""
    log_r = logprobs - ref_logprobs
    if kind == "k1":
        return log_r
    if kind == "k2":
        return 0.5 * log_r.square()
    if kind in ("k3", "low-var-kl"):
        k3 = torch.exp(-log_r) - 1.0 + log_r
        return k3.clamp(-10.0, 10.0) if kind == "low-var-kl" else k3
    raise ValueError(f"kl_type={kind!r}; expected one of {KL_TYPES}")


def importance_weights(
    old_logprobs: torch.Tensor,
    rollout_logprobs: torch.Tensor,
    *,
    mode: Literal["tis", "mis"],
    cap: float,
    floor: float = 0.0,
) -> torch.Tensor:
    """Correction for the gap between the engine (behaviour) and the trainer's old policy.

    w = pi_old / pi_engine per token, detached.
    * tis (truncated IS): min(w, cap).
    * mis (masked IS): w where floor <= w <= cap, else 0 (the token is dropped)."""
    w = torch.exp(old_logprobs - rollout_logprobs).detach()
    if mode == "tis":
        return w.clamp(max=cap)
    if mode == "mis":
        keep = (w <= cap) & (w >= floor)
        return torch.where(keep, w, torch.zeros_like(w))
    raise ValueError(f"importance correction {mode!r}; expected 'tis' or 'mis'")


def value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    *,
    clip: float | None = 0.2,
) -> torch.Tensor:
    """Clipped value loss, per token: 0.5 max((v - R)^2, (v_clip - R)^2),
    v_clip = v_old + clamp(v - v_old, -clip, clip). `clip=None` gives 0.5 (v - R)^2."""
    unclipped = (values - returns).square()
    if clip is None:
        return 0.5 * unclipped
    v_clip = old_values + (values - old_values).clamp(-clip, clip)
    return 0.5 * torch.maximum(unclipped, (v_clip - returns).square())


def sft_loss(logprobs: torch.Tensor) -> torch.Tensor:
    """Cross-entropy per token: -log p(target)."""
    return -logprobs

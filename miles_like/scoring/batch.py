"""Scored groups of trajectories -> the trainer's `RLBatch`, with advantages from the recipe's
estimator.

Sample order is group-major (prompt i's n trajectories are rows i*n .. i*n+n-1), which is what
the group estimators' [groups, n] reward matrix assumes. A trajectory's response is everything
after its prompt: the tokens the engine sampled (the stop token included: the policy must learn
to stop) and, in a multi-turn trajectory, the tokens appended between turns. `loss_masks` (1 on
sampled tokens) keeps the latter out of every loss and metric; the engine's log-probs travel
along for the trainer's mismatch metrics and TIS / MIS, a mixture of experts' routes for the
trainer to replay (`RLBatch.routed_experts`; every trajectory has them or none does).

Token-level estimators (REINFORCE++, GAE) see only the sampled tokens, in order: appended tokens
are the environment's answer, not actions, so rewards are discounted, KL-penalized and bootstrapped
over the actions alone (the value after a tool's result is the next action's). Their advantages
are 0 on appended tokens. With every token sampled (single turn) this is the plain estimator.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch

from miles_like.rollouts.manager import Group
from miles_like.scoring import advantages as adv
from trainer import RLBatch


def samples_batch(groups: Sequence[Group]) -> RLBatch:
    tokens, prompt_lens, engine_lp, masks, routes = [], [], [], [], []
    for g in groups:
        for t in g.trajectories:
            routes.append(t.routes)
            tokens.append(list(t.token_ids))
            prompt_lens.append(t.prompt_len)
            # float64 holds the engine's values exactly, whether it ran in float32 or float64
            engine_lp.append(torch.tensor(t.logprobs, dtype=torch.float64))
            masks.append(torch.tensor(t.loss_mask, dtype=torch.float32))
    routed = sum(r is not None for r in routes)
    if routed not in (0, len(routes)):
        raise ValueError(
            f"{routed} of {len(routes)} trajectories have routes; a rollout function must pass "
            "every turn's Generation.routes to TrajectoryBuilder.sampled"
        )
    return RLBatch(
        tokens=tokens,
        prompt_lens=prompt_lens,
        rollout_logprobs=engine_lp,
        loss_masks=masks,
        routed_experts=routes if routed else None,
    )


def _sampled(values: Sequence[torch.Tensor], masks: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    return [v[m > 0] for v, m in zip(values, masks)]


def _spread(values: Sequence[torch.Tensor], masks: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Inverse of `_sampled`: per response token, 0 where the mask is 0."""
    out = []
    for v, m in zip(values, masks):
        full = torch.zeros(m.numel(), dtype=v.dtype)
        full[m > 0] = v
        out.append(full)
    return out


def rewards_matrix(groups: Sequence[Group]) -> torch.Tensor:
    return torch.tensor([g.rewards for g in groups], dtype=torch.float32)


def with_advantages(
    batch: RLBatch,
    groups: Sequence[Group],
    algorithm,
    *,
    values: list[torch.Tensor] | None = None,
    ref_logprobs: list[torch.Tensor] | None = None,
) -> tuple[RLBatch, dict[str, float]]:
    """The batch with per-token advantages (and, for GAE, the critic's returns)."""
    rewards = rewards_matrix(groups)
    masks = batch.loss_masks or [
        torch.ones(batch.response_len(i)) for i in range(len(batch.tokens))
    ]
    lengths = [int((m > 0).sum()) for m in masks]
    kl = None
    if algorithm.kl_reward_coef > 0:
        if ref_logprobs is None:
            raise ValueError("algorithm.kl_reward_coef > 0 needs the reference's log-probs")
        # k1 estimate per token of KL(policy || reference), with the sampling policy's log-probs
        kl = _sampled([lp - ref for lp, ref in zip(batch.rollout_logprobs, ref_logprobs)], masks)
    name = algorithm.advantage
    returns = None
    if name in ("grpo", "dr_grpo", "rloo"):
        per_sample = {"grpo": adv.grpo, "dr_grpo": adv.dr_grpo, "rloo": adv.rloo}[name](rewards)
        token_adv = adv.per_token(per_sample, lengths)
    elif name == "reinforce_pp":
        token_adv = adv.reinforce_pp(
            rewards.reshape(-1),
            lengths,
            kl=kl,
            kl_coef=algorithm.kl_reward_coef,
            gamma=algorithm.gamma,
        )
    elif name == "gae":
        if values is None:
            raise ValueError("algorithm.advantage=gae needs the critic's values")
        result = adv.gae(
            rewards.reshape(-1),
            _sampled(values, masks),
            gamma=algorithm.gamma,
            lam=algorithm.gae_lambda,
            kl=kl,
            kl_coef=algorithm.kl_reward_coef,
        )
        # PPO practice (verl, OpenRLHF): whiten GAE advantages over the batch; returns stay raw.
        token_adv, returns = adv.whiten(result.advantages), _spread(result.returns, masks)
    else:  # the recipe schema admits only the names above
        raise ValueError(f"algorithm.advantage={name!r}")
    flat = torch.cat([a.reshape(-1) for a in token_adv])
    metrics = {"advantage_mean": float(flat.mean()), "advantage_abs_mean": float(flat.abs().mean())}
    if kl is not None:
        metrics["kl_in_reward"] = float(torch.cat(kl).mean())
    batch = dataclasses.replace(
        batch,
        advantages=[a.float() for a in _spread(token_adv, masks)],
        returns=None if returns is None else [r.float() for r in returns],
    )
    return batch, metrics

"""Scored groups -> the trainer's `RLBatch`, with advantages from the recipe's estimator.

Sample order is group-major (prompt i's n samples are rows i*n .. i*n+n-1), which is what the
group estimators' [groups, n] reward matrix assumes. The response is everything the engine
generated, the stop token included (the policy must learn to stop); the engine's log-probs of
those tokens travel along for the trainer's mismatch metrics and TIS / MIS.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch

from miles_like import advantages as adv
from miles_like.rollout_manager import Group
from trainer import RLBatch


def samples_batch(groups: Sequence[Group]) -> RLBatch:
    tokens, prompt_lens, engine_lp = [], [], []
    for g in groups:
        for s in g.samples:
            tokens.append(list(g.problem.prompt_ids) + list(s.token_ids))
            prompt_lens.append(len(g.problem.prompt_ids))
            # float64 holds the engine's values exactly, whether it ran in float32 or float64
            engine_lp.append(torch.tensor(s.logprobs, dtype=torch.float64))
    return RLBatch(tokens=tokens, prompt_lens=prompt_lens, rollout_logprobs=engine_lp)


def rewards_matrix(groups: Sequence[Group]) -> torch.Tensor:
    return torch.tensor([g.rewards for g in groups], dtype=torch.float32)


def with_advantages(batch: RLBatch, groups: Sequence[Group], algorithm, *,
                    values: list[torch.Tensor] | None = None,
                    ref_logprobs: list[torch.Tensor] | None = None
                    ) -> tuple[RLBatch, dict[str, float]]:
    """The batch with per-token advantages (and, for GAE, the critic's returns)."""
    rewards = rewards_matrix(groups)
    lengths = [batch.response_len(i) for i in range(len(batch.tokens))]
    kl = None
    if algorithm.kl_reward_coef > 0:
        if ref_logprobs is None:
            raise ValueError("algorithm.kl_reward_coef > 0 needs the reference's log-probs")
        # k1 estimate per token of KL(policy || reference), with the sampling policy's log-probs
        kl = [lp - ref for lp, ref in zip(batch.rollout_logprobs, ref_logprobs)]
    name = algorithm.advantage
    returns = None
    if name in ("grpo", "dr_grpo", "rloo"):
        per_sample = {"grpo": adv.grpo, "dr_grpo": adv.dr_grpo, "rloo": adv.rloo}[name](rewards)
        token_adv = adv.per_token(per_sample, lengths)
    elif name == "reinforce_pp":
        token_adv = adv.reinforce_pp(rewards.reshape(-1), lengths, kl=kl,
                                     kl_coef=algorithm.kl_reward_coef, gamma=algorithm.gamma)
    elif name == "gae":
        if values is None:
            raise ValueError("algorithm.advantage=gae needs the critic's values")
        result = adv.gae(rewards.reshape(-1), values, gamma=algorithm.gamma,
                         lam=algorithm.gae_lambda, kl=kl, kl_coef=algorithm.kl_reward_coef)
        # PPO practice (verl, OpenRLHF): whiten GAE advantages over the batch; returns stay raw.
        token_adv, returns = adv.whiten(result.advantages), result.returns
    else:  # the recipe schema admits only the names above
        raise ValueError(f"algorithm.advantage={name!r}")
    flat = torch.cat([a.reshape(-1) for a in token_adv])
    metrics = {"advantage_mean": float(flat.mean()), "advantage_abs_mean": float(flat.abs().mean())}
    if kl is not None:
        metrics["kl_in_reward"] = float(torch.cat(kl).mean())
    batch = dataclasses.replace(batch, advantages=[a.float() for a in token_adv],
                                returns=None if returns is None else [r.float() for r in returns])
    return batch, metrics

"""Advantage estimators as pure functions of rewards (and values / KL), on tensors.

Group estimators take `rewards` of shape [groups, n] (the n samples of one prompt in a row) and
return one advantage per sample, same shape; `per_token` spreads them over response tokens.
Token-level estimators (REINFORCE++, GAE) take one scalar reward per sample and per-token
tensors (KL, values), and return a list of per-response-token tensors.

Token-level rewards: the sample's reward is given at its last response token, and an optional
KL penalty `-kl_coef * kl_t` at every token t (PPO / REINFORCE++ "KL in reward").
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch


def _groups(rewards: torch.Tensor, min_n: int = 2) -> torch.Tensor:
    if rewards.dim() != 2 or rewards.shape[1] < min_n:
        raise ValueError(
            f"rewards must have shape [groups, n] with n >= {min_n}; got {tuple(rewards.shape)}"
        )
    return rewards.float()


def grpo(rewards: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """(r - group mean) / (group std + eps); std is the unbiased sample std (as DeepSeekMath).
    A group of equal rewards gets advantage 0."""
    r = _groups(rewards)
    return (r - r.mean(dim=1, keepdim=True)) / (r.std(dim=1, keepdim=True) + eps)


def dr_grpo(rewards: torch.Tensor) -> torch.Tensor:
    """Dr. GRPO: r - group mean, without the std division (which up-weights easy / hard groups)."""
    r = _groups(rewards)
    return r - r.mean(dim=1, keepdim=True)


def rloo(rewards: torch.Tensor) -> torch.Tensor:
    """RLOO: r_i - mean of the other n - 1 rewards of the group (= n / (n - 1) * (r_i - mean))."""
    r = _groups(rewards)
    n = r.shape[1]
    return r - (r.sum(dim=1, keepdim=True) - r) / (n - 1)


def per_token(advantages: torch.Tensor, lengths: Sequence[int]) -> list[torch.Tensor]:
    """One advantage per sample (any shape, flattened in order) -> a constant tensor per sample of
    its response length."""
    flat = advantages.reshape(-1)
    if flat.numel() != len(lengths):
        raise ValueError(f"{flat.numel()} advantages for {len(lengths)} samples")
    return [flat[i].expand(int(n)).clone() for i, n in enumerate(lengths)]


def token_rewards(
    reward: float | torch.Tensor, length: int, kl: torch.Tensor | None = None, kl_coef: float = 0.0
) -> torch.Tensor:
    """Per-token rewards of one sample: `reward` at the last token, `-kl_coef * kl` everywhere."""
    if length < 1:
        raise ValueError("a sample needs at least one response token to carry its reward")
    out = torch.zeros(length)
    if kl is not None and kl_coef != 0.0:
        if kl.numel() != length:
            raise ValueError(f"kl has {kl.numel()} values for {length} response tokens")
        out = out - kl_coef * kl.reshape(-1).float()
    out[-1] += float(reward)
    return out


def discounted_returns(rewards: torch.Tensor, gamma: float) -> torch.Tensor:
    """G_t = sum_{s >= t} gamma^(s - t) r_s over one sample's tokens."""
    out = torch.empty_like(rewards, dtype=torch.float32)
    running = 0.0
    for t in range(rewards.numel() - 1, -1, -1):
        running = float(rewards[t]) + gamma * running
        out[t] = running
    return out


def whiten(values: Sequence[torch.Tensor], eps: float = 1e-8) -> list[torch.Tensor]:
    """(x - mean) / sqrt(var + eps) with the mean and population variance over every token of
    every sample (the global batch normalisation of REINFORCE++)."""
    flat = torch.cat([v.reshape(-1).float() for v in values])
    mean, var = flat.mean(), flat.var(unbiased=False)
    scale = torch.rsqrt(var + eps)
    return [(v.float() - mean) * scale for v in values]


def _check_samples(rewards: torch.Tensor, n: int, what: str) -> torch.Tensor:
    r = rewards.reshape(-1)
    if r.numel() != n:
        raise ValueError(f"{r.numel()} rewards for {n} {what}")
    return r


def reinforce_pp(
    rewards: torch.Tensor,
    lengths: Sequence[int],
    kl: Sequence[torch.Tensor] | None = None,
    kl_coef: float = 0.0,
    gamma: float = 1.0,
    eps: float = 1e-8,
) -> list[torch.Tensor]:
    """REINFORCE++: per-token discounted returns of (reward at the end, -kl_coef * KL per token),
    normalised over the whole batch (`whiten`). No critic, no group baseline."""
    r = _check_samples(rewards, len(lengths), "samples")
    returns = [
        discounted_returns(
            token_rewards(r[i], int(n), None if kl is None else kl[i], kl_coef), gamma
        )
        for i, n in enumerate(lengths)
    ]
    return whiten(returns, eps)


class GAEResult(NamedTuple):
    advantages: list[torch.Tensor]  # per response token
    returns: list[torch.Tensor]  # advantages + values: the critic's targets


def gae(
    rewards: torch.Tensor,
    values: Sequence[torch.Tensor],
    gamma: float = 1.0,
    lam: float = 1.0,
    kl: Sequence[torch.Tensor] | None = None,
    kl_coef: float = 0.0,
) -> GAEResult:
    """Generalised advantage estimation per sample. `values[i][t]` is V of the state before
    response token t; the state after the last token is terminal (V = 0).

    delta_t = r_t + gamma V_{t+1} - V_t,   A_t = delta_t + gamma lam A_{t+1},   R_t = A_t + V_t."""
    r = _check_samples(rewards, len(values), "value tensors")
    advantages, returns = [], []
    for i, v in enumerate(values):
        v = v.reshape(-1).float()
        rew = token_rewards(r[i], v.numel(), None if kl is None else kl[i], kl_coef)
        adv = torch.empty_like(v)
        running, next_value = 0.0, 0.0
        for t in range(v.numel() - 1, -1, -1):
            delta = float(rew[t]) + gamma * next_value - float(v[t])
            running = delta + gamma * lam * running
            adv[t] = running
            next_value = float(v[t])
        advantages.append(adv)
        returns.append(adv + v)
    return GAEResult(advantages, returns)

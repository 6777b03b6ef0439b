"""Scored groups -> RLBatch with advantages: layout, and each estimator against closed forms."""

from __future__ import annotations

import math

import pytest
import torch

from miles_like.data import Problem
from miles_like.recipe.sections import AlgorithmSection
from miles_like.rollouts.manager import Group
from miles_like.rollouts.trajectory import TrajectoryBuilder, single_turn
from miles_like.run.trainer_worker import mini_batches
from miles_like.scoring.batch import samples_batch, with_advantages


def group(prompt_ids, responses, rewards):
    trajectories = [single_turn(prompt_ids, r, [-0.5] * len(r), 0, "stop", "") for r in responses]
    return Group(Problem("p", list(prompt_ids), "a"), trajectories, list(rewards), list(rewards))


GROUPS = [
    group([5, 6], [[1, 2, 3], [4]], [1.0, 0.0]),
    group([7], [[8, 9], [1, 1, 1, 1]], [0.0, 0.0]),
]


def test_batch_is_group_major_prompt_plus_response():
    b = samples_batch(GROUPS)
    assert b.tokens == [[5, 6, 1, 2, 3], [5, 6, 4], [7, 8, 9], [7, 1, 1, 1, 1]]
    assert b.prompt_lens == [2, 2, 1, 1]
    assert [lp.tolist() for lp in b.rollout_logprobs] == [
        [-0.5] * 3,
        [-0.5],
        [-0.5] * 2,
        [-0.5] * 4,
    ]


def test_grpo_advantages_are_per_token_constants():
    b, metrics = with_advantages(samples_batch(GROUPS), GROUPS, AlgorithmSection(advantage="grpo"))
    # group 0: rewards [1, 0]: mean 0.5, unbiased std sqrt(0.5); group 1 all equal: 0
    s = 0.5 / (math.sqrt(0.5) + 1e-6)
    expected = [[s] * 3, [-s], [0.0] * 2, [0.0] * 4]
    for got, want in zip(b.advantages, expected):
        torch.testing.assert_close(got, torch.tensor(want), atol=1e-6, rtol=0)
    assert b.returns is None
    assert metrics["advantage_abs_mean"] == pytest.approx(4 * s / 10, abs=1e-6)


def test_reinforce_pp_whitens_over_all_tokens():
    b, _ = with_advantages(
        samples_batch(GROUPS), GROUPS, AlgorithmSection(advantage="reinforce_pp", gamma=1.0)
    )
    flat = torch.cat(b.advantages)
    assert flat.mean().item() == pytest.approx(0.0, abs=1e-6)
    assert flat.var(unbiased=False).item() == pytest.approx(1.0, abs=1e-4)
    # gamma = 1: every token of a sample has the same return; sample 0 (reward 1) is highest
    assert torch.all(b.advantages[0] == b.advantages[0][0])
    assert b.advantages[0][0] > b.advantages[1][0]


def test_gae_returns_and_whitened_advantages():
    values = [torch.full((s.response_len,), 0.25) for g in GROUPS for s in g.trajectories]
    b, _ = with_advantages(
        samples_batch(GROUPS),
        GROUPS,
        AlgorithmSection(advantage="gae", gamma=1.0, gae_lambda=1.0),
        values=values,
    )
    # gamma = lam = 1, terminal V = 0: return at every token = the sample's reward
    for ret, r in zip(b.returns, [1.0, 0.0, 0.0, 0.0]):
        torch.testing.assert_close(ret, torch.full_like(ret, r))
    flat = torch.cat(b.advantages)
    assert flat.mean().item() == pytest.approx(0.0, abs=1e-6)


def test_kl_in_reward_uses_reference_logprobs():
    ref = [torch.full((s.response_len,), -0.5) for g in GROUPS for s in g.trajectories]
    alg = AlgorithmSection(advantage="reinforce_pp", kl_reward_coef=0.1)
    _, metrics = with_advantages(samples_batch(GROUPS), GROUPS, alg, ref_logprobs=ref)
    assert metrics["kl_in_reward"] == 0.0  # the sampling policy equals the reference
    with pytest.raises(ValueError, match="reference"):
        with_advantages(samples_batch(GROUPS), GROUPS, alg)


@pytest.mark.parametrize("n,updates", [(8, 1), (8, 3), (5, 5), (10, 4)])
def test_mini_batches_partition_in_order(n, updates):
    parts = mini_batches(n, updates)
    assert len(parts) == updates and sum(parts, []) == list(range(n))
    assert max(map(len, parts)) - min(map(len, parts)) <= 1


# A two-turn trajectory: prompt [5], sampled [1, 2], appended (a tool's answer) [7, 7, 7],
# sampled [3]; and a one-turn one, so the batch mixes both.
def two_turns():
    b = TrajectoryBuilder([5])
    b.sampled([1, 2], [-0.1, -0.2], 3)
    b.appended([7, 7, 7])
    b.sampled([3], [-0.3], 4)
    return b.build(response_text="x")


MULTI = [
    Group(
        Problem("p", [5], "a"),
        [two_turns(), single_turn([5], [4, 4], [-0.4, -0.5], 4, "stop", "y")],
        [1.0, 0.0],
        [1.0, 0.0],
    )
]


def test_multi_turn_batch_masks_exactly_the_sampled_tokens():
    b = samples_batch(MULTI)
    assert b.tokens == [[5, 1, 2, 7, 7, 7, 3], [5, 4, 4]]
    assert [m.tolist() for m in b.loss_masks] == [[1, 1, 0, 0, 0, 1], [1, 1]]
    assert [lp.tolist() for lp in b.rollout_logprobs] == [[-0.1, -0.2, 0, 0, 0, -0.3], [-0.4, -0.5]]


def test_gae_over_multi_turn_sees_only_the_actions():
    """gamma = 0.5, lam = 1, reward 1 / 0 at the last sampled token; V = 0.1 * (t + 1) at
    response position t. Over the actions (positions 0, 1, 5 of sample 0): the value after
    action 1 is V at position 5 (0.6), not at the tool's tokens."""
    values = [torch.tensor([0.1, 0.2, 9.0, 9.0, 9.0, 0.6]), torch.tensor([0.1, 0.2])]
    b, _ = with_advantages(
        samples_batch(MULTI),
        MULTI,
        AlgorithmSection(advantage="gae", gamma=0.5, gae_lambda=1.0),
        values=values,
    )
    # actions' rewards [0, 0, 1], values [0.1, 0.2, 0.6]; returns G_t = sum gamma^k r
    want = [[0.25, 0.5, 0.0, 0.0, 0.0, 1.0], [0.0, 0.0]]
    for got, w in zip(b.returns, want):
        torch.testing.assert_close(got, torch.tensor(w), atol=1e-6, rtol=0)
    # advantages (before whitening) = returns - values on actions: whitened over the 5 actions
    raw = torch.tensor([0.25 - 0.1, 0.5 - 0.2, 1.0 - 0.6, -0.1, -0.2])
    white = (raw - raw.mean()) / torch.sqrt(raw.var(unbiased=False) + 1e-8)
    torch.testing.assert_close(
        b.advantages[0], torch.tensor([white[0], white[1], 0, 0, 0, white[2]]), atol=1e-5, rtol=0
    )
    torch.testing.assert_close(b.advantages[1], white[3:], atol=1e-5, rtol=0)


def test_reinforce_pp_kl_and_discount_skip_appended_tokens():
    """KL in reward uses only sampled tokens (the engine log-probs there are real; 0 on the
    tool's tokens would be garbage) and gamma discounts per action, not per token."""
    ref = [
        torch.tensor([-0.1, -0.2, -50.0, -50.0, -50.0, -0.3], dtype=torch.float64),
        torch.tensor([-0.4, -0.5], dtype=torch.float64),
    ]
    alg = AlgorithmSection(advantage="reinforce_pp", gamma=0.5, kl_reward_coef=0.1)
    b, metrics = with_advantages(samples_batch(MULTI), MULTI, alg, ref_logprobs=ref)
    assert metrics["kl_in_reward"] == 0.0
    returns = torch.tensor([0.25, 0.5, 1.0, 0.0, 0.0])  # per action, KL 0
    white = (returns - returns.mean()) / torch.sqrt(returns.var(unbiased=False) + 1e-8)
    torch.testing.assert_close(
        b.advantages[0], torch.tensor([white[0], white[1], 0, 0, 0, white[2]]), atol=1e-5, rtol=0
    )

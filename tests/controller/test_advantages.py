"""Advantage estimators against hand computations and closed forms."""

from __future__ import annotations

import math

import pytest
import torch

from miles_like.scoring import advantages as A


def close(actual, expected, tol=1e-6):
    torch.testing.assert_close(
        torch.as_tensor(actual, dtype=torch.float32),
        torch.as_tensor(expected, dtype=torch.float32),
        atol=tol,
        rtol=0,
    )


def test_grpo_hand_computed():
    # [1, 0, 0, 1]: mean 1/2, unbiased std sqrt(1/3); [0, 1, 2]: mean 1, std 1.
    rewards = torch.tensor([[1.0, 0.0, 0.0, 1.0]])
    s = 0.5 / (1 / math.sqrt(3) + 1e-6)
    close(A.grpo(rewards), [[s, -s, -s, s]])
    close(A.grpo(torch.tensor([[0.0, 1.0, 2.0]]), eps=0.0), [[-1.0, 0.0, 1.0]])


def test_grpo_equal_group_is_zero_and_groups_are_independent():
    rewards = torch.tensor([[2.0, 2.0, 2.0], [0.0, 1.0, 2.0]])
    out = A.grpo(rewards)
    close(out[0], [0.0, 0.0, 0.0])
    close(out[1], [-1.0, 0.0, 1.0], tol=1e-5)


def test_dr_grpo_is_mean_centred_only():
    close(
        A.dr_grpo(torch.tensor([[0.0, 1.0, 2.0], [1.0, 0.0, 0.0]])),
        [[-1.0, 0.0, 1.0], [2 / 3, -1 / 3, -1 / 3]],
    )


def test_rloo_leave_one_out():
    # 0 - (1+2)/2, 1 - (0+2)/2, 2 - (0+1)/2
    close(A.rloo(torch.tensor([[0.0, 1.0, 2.0]])), [[-1.5, 0.0, 1.5]])
    r = torch.tensor([[3.0, 1.0, 4.0, 1.0, 5.0]])
    n = r.shape[1]
    close(A.rloo(r), n / (n - 1) * (r - r.mean()))  # the closed form
    close(A.rloo(r).sum(), 0.0, tol=1e-5)


@pytest.mark.parametrize("fn", [A.grpo, A.dr_grpo, A.rloo])
def test_group_estimators_need_groups(fn):
    with pytest.raises(ValueError, match="n >= 2"):
        fn(torch.tensor([[1.0], [0.0]]))
    with pytest.raises(ValueError, match="shape"):
        fn(torch.tensor([1.0, 0.0]))


def test_per_token_broadcast():
    out = A.per_token(torch.tensor([[0.5, -0.5]]), [3, 1])
    close(out[0], [0.5, 0.5, 0.5])
    close(out[1], [-0.5])
    with pytest.raises(ValueError):
        A.per_token(torch.tensor([1.0]), [1, 2])


def test_token_rewards_and_discounted_returns():
    rew = A.token_rewards(1.0, 2, kl=torch.tensor([0.5, 0.25]), kl_coef=0.1)
    close(rew, [-0.05, 0.975])
    # G1 = 0.975, G0 = -0.05 + 0.5 * 0.975
    close(A.discounted_returns(rew, 0.5), [0.4375, 0.975])
    close(A.discounted_returns(torch.tensor([1.0, 2.0, 3.0]), 1.0), [6.0, 5.0, 3.0])


def test_reinforce_pp_global_normalisation():
    # Returns [1, 1] and [0]: mean 2/3, population variance 2/9 -> [1/sqrt2, 1/sqrt2], [-sqrt2].
    out = A.reinforce_pp(torch.tensor([1.0, 0.0]), [2, 1], eps=0.0)
    close(out[0], [1 / math.sqrt(2)] * 2)
    close(out[1], [-math.sqrt(2)])


def test_reinforce_pp_kl_in_reward():
    # Returns [0.4375, 0.975] (above); two distinct values whiten to [-1, 1].
    out = A.reinforce_pp(
        torch.tensor([1.0]), [2], kl=[torch.tensor([0.5, 0.25])], kl_coef=0.1, gamma=0.5, eps=0.0
    )
    close(out[0], [-1.0, 1.0])
    # without KL and gamma 1 the two tokens have equal returns: all advantages 0 (up to eps)
    flat = A.reinforce_pp(torch.tensor([1.0]), [2], eps=1e-8)[0]
    close(flat, [0.0, 0.0])


def test_gae_hand_computed():
    # V = [0.5, 0.25], reward 1 at the end, gamma 0.9, lambda 0.8:
    # delta1 = 1 - 0.25 = 0.75; delta0 = 0.9 * 0.25 - 0.5 = -0.275; A0 = -0.275 + 0.72 * 0.75
    res = A.gae(torch.tensor([1.0]), [torch.tensor([0.5, 0.25])], gamma=0.9, lam=0.8)
    close(res.advantages[0], [0.265, 0.75])
    close(res.returns[0], [0.765, 1.0])


def test_gae_lambda_limits():
    values, r = [torch.tensor([0.5, 0.25])], torch.tensor([1.0])
    # lambda = 1: returns are the Monte Carlo discounted return [0.9, 1]
    close(A.gae(r, values, gamma=0.9, lam=1.0).returns[0], [0.9, 1.0])
    # lambda = 0: advantages are the one-step TD errors
    close(A.gae(r, values, gamma=0.9, lam=0.0).advantages[0], [-0.275, 0.75])


def test_gae_with_kl_penalty_and_several_samples():
    res = A.gae(
        torch.tensor([1.0, 0.0]),
        [torch.zeros(2), torch.zeros(1)],
        gamma=1.0,
        lam=1.0,
        kl=[torch.tensor([1.0, 1.0]), torch.tensor([2.0])],
        kl_coef=0.5,
    )
    # rewards [-0.5, 0.5] -> returns [0, 0.5]; [-1] -> [-1]; zero values: advantages = returns
    close(res.returns[0], [0.0, 0.5])
    close(res.advantages[1], [-1.0])


def test_whiten_matches_definition():
    xs = [torch.tensor([1.0, 2.0]), torch.tensor([3.0, 4.0, 10.0])]
    flat = torch.tensor([1.0, 2.0, 3.0, 4.0, 10.0])
    expect = (flat - flat.mean()) / flat.std(unbiased=False)
    close(torch.cat(A.whiten(xs, eps=0.0)), expect)


def test_token_level_input_errors():
    with pytest.raises(ValueError, match="at least one response token"):
        A.reinforce_pp(torch.tensor([1.0]), [0])
    with pytest.raises(ValueError, match="rewards for"):
        A.gae(torch.tensor([1.0, 2.0]), [torch.zeros(3)])
    with pytest.raises(ValueError, match="kl has"):
        A.token_rewards(1.0, 3, kl=torch.zeros(2), kl_coef=0.1)

"""Every loss in trainer/losses.py against a hand computation in plain Python floats.

The fixed batch: two sequences with 3 and 2 response tokens; token 2 of sequence 0 is masked."""

from __future__ import annotations

import math

import pytest
import torch

from trainer import losses

LOGP = [-1.0, -0.5, -2.0, -0.2, -1.5]
OLD = [-1.2, -0.4, -1.0, -0.9, -1.4]
ADV = [1.0, -2.0, 0.5, -1.0, 3.0]
MASK = [1.0, 1.0, 0.0, 1.0, 1.0]
SEQ = [0, 0, 0, 1, 1]


def t(xs):
    return torch.tensor(xs, dtype=torch.float64)


SEQ_IDS = torch.tensor(SEQ)


def _ppo_token(lp, old, a, lo, hi, dual=None):
    r = math.exp(lp - old)
    clipped_r = min(max(r, 1 - lo), 1 + hi)
    loss = max(-a * r, -a * clipped_r)
    if dual is not None and a < 0:
        loss = min(loss, -a * dual)
    return loss


def test_aggregation_modes_by_hand():
    v = [2.0, 4.0, 100.0, 1.0, 3.0]  # the masked 100 must never count
    # token-mean: (2 + 4 + 1 + 3) / 4
    assert float(losses.aggregate(t(v), t(MASK), SEQ_IDS, "token-mean")) == pytest.approx(2.5)
    # seq-mean: (mean(2, 4) + mean(1, 3)) / 2 = (3 + 2) / 2
    assert float(losses.aggregate(t(v), t(MASK), SEQ_IDS, "seq-mean")) == pytest.approx(2.5)
    # seq-mean-token-sum: (6 + 4) / 2
    assert float(losses.aggregate(t(v), t(MASK), SEQ_IDS, "seq-mean-token-sum")) == pytest.approx(
        5.0
    )
    # explicit global normalizers (a micro-batch's share of a bigger batch)
    assert float(
        losses.aggregate(t(v), t(MASK), SEQ_IDS, "token-mean", total_tokens=10)
    ) == pytest.approx(1.0)
    assert float(
        losses.aggregate(t(v), t(MASK), SEQ_IDS, "seq-mean", total_seqs=5)
    ) == pytest.approx(1.0)
    with pytest.raises(ValueError, match="loss_agg"):
        losses.aggregate(t(v), t(MASK), SEQ_IDS, "mean")


@pytest.mark.parametrize(
    "lo,hi,dual", [(0.2, 0.2, None), (0.2, 0.28, None), (0.2, 0.28, 3.0), (0.1, 0.1, 1.5)]
)
def test_ppo_clipped_surrogate_by_hand(lo, hi, dual):
    out = losses.ppo_policy_loss(t(LOGP), t(OLD), t(ADV), clip_low=lo, clip_high=hi, dual_clip=dual)
    want = [_ppo_token(a, b, c, lo, hi, dual) for a, b, c in zip(LOGP, OLD, ADV)]
    assert out.loss.tolist() == pytest.approx(want, abs=1e-12)
    assert out.ratio.tolist() == pytest.approx([math.exp(a - b) for a, b in zip(LOGP, OLD)])


def test_clip_higher_changes_only_the_upper_bound():
    # token 0: r = e^0.2 = 1.2214, A > 0. Symmetric 0.2 clips it at 1.2, clip-higher 0.28 not.
    sym = losses.ppo_policy_loss(t(LOGP), t(OLD), t(ADV), clip_low=0.2, clip_high=0.2)
    high = losses.ppo_policy_loss(t(LOGP), t(OLD), t(ADV), clip_low=0.2, clip_high=0.28)
    assert float(sym.loss[0]) == pytest.approx(-1.2)
    assert float(high.loss[0]) == pytest.approx(-math.exp(0.2))
    assert sym.clipped[0] == 1 and high.clipped[0] == 0


def test_dual_clip_bounds_negative_advantages():
    # token 3: r = e^0.7 = 2.01, A = -1: the plain clipped loss is 2.01, dual clip 1.5 caps it
    out = losses.ppo_policy_loss(
        t(LOGP), t(OLD), t(ADV), clip_low=0.2, clip_high=0.2, dual_clip=1.5
    )
    assert float(out.loss[3]) == pytest.approx(1.5)
    with pytest.raises(ValueError, match="dual_clip"):
        losses.ppo_policy_loss(t(LOGP), t(OLD), t(ADV), dual_clip=0.9)


def test_ppo_gradient_by_hand():
    lp = t(LOGP).requires_grad_()
    out = losses.ppo_policy_loss(lp, t(OLD), t(ADV), clip_low=0.2, clip_high=0.2)
    out.loss.sum().backward()
    for i, (a, b, adv) in enumerate(zip(LOGP, OLD, ADV)):
        r = math.exp(a - b)
        unclipped_active = -adv * r >= -adv * min(max(r, 0.8), 1.2)
        want = -adv * r if unclipped_active else 0.0  # d(-A r)/dlogp = -A r; clipped: 0
        assert float(lp.grad[i]) == pytest.approx(want, abs=1e-12), i


def test_gspo_sequence_ratio_by_hand():
    lo, hi = 0.05, 0.1
    lp = t(LOGP).requires_grad_()
    out = losses.gspo_policy_loss(lp, t(OLD), t(ADV), t(MASK), SEQ_IDS, clip_low=lo, clip_high=hi)
    # s_0 = exp(mean over unmasked tokens 0, 1 of (lp - old)) = exp((0.2 - 0.1) / 2)
    s0 = math.exp(((LOGP[0] - OLD[0]) + (LOGP[1] - OLD[1])) / 2)
    s1 = math.exp(((LOGP[3] - OLD[3]) + (LOGP[4] - OLD[4])) / 2)
    s = [s0, s0, s0, s1, s1]
    assert out.ratio.tolist() == pytest.approx(s)
    want = [max(-a * si, -a * min(max(si, 1 - lo), 1 + hi)) for a, si in zip(ADV, s)]
    assert out.loss.tolist() == pytest.approx(want, abs=1e-12)
    # gradient: s_i * d logp_t where the unclipped branch is active, times -A
    out.loss.sum().backward()
    for i, (a, si) in enumerate(zip(ADV, s)):
        active = -a * si >= -a * min(max(si, 1 - lo), 1 + hi)
        assert float(lp.grad[i]) == pytest.approx(-a * si if active else 0.0, abs=1e-12)


@pytest.mark.parametrize("kind", ["k1", "k2", "k3", "low-var-kl"])
def test_kl_estimators_by_hand(kind):
    ref = [-1.1, -0.3, -2.5, -12.0, -1.5]
    got = losses.kl_divergence(t(LOGP), t(ref), kind).tolist()
    want = []
    for a, b in zip(LOGP, ref):
        x = a - b
        if kind == "k1":
            want.append(x)
        elif kind == "k2":
            want.append(x * x / 2)
        else:
            k3 = math.exp(-x) - 1 + x
            want.append(min(max(k3, -10.0), 10.0) if kind == "low-var-kl" else k3)
    assert got == pytest.approx(want, abs=1e-12)
    # token 3: x = 11.8 -> k3 = 10.8..., clamped to 10 for low-var-kl
    if kind == "low-var-kl":
        assert got[3] == 10.0


def test_kl_is_zero_when_policies_match():
    for kind in losses.KL_TYPES:
        assert torch.equal(
            losses.kl_divergence(t(LOGP), t(LOGP), kind), torch.zeros(5, dtype=torch.float64)
        )


def test_importance_corrections_by_hand():
    engine = [-1.0, -1.4, -0.5, -0.9, -3.0]
    w = [math.exp(a - b) for a, b in zip(OLD, engine)]
    tis = losses.importance_weights(t(OLD), t(engine), mode="tis", cap=2.0).tolist()
    assert tis == pytest.approx([min(x, 2.0) for x in w])
    mis = losses.importance_weights(t(OLD), t(engine), mode="mis", cap=2.0, floor=0.5).tolist()
    assert mis == pytest.approx([x if 0.5 <= x <= 2.0 else 0.0 for x in w])
    # the weight of token 4 is e^1.6 = 4.95: TIS truncates, MIS drops it
    assert tis[4] == 2.0 and mis[4] == 0.0


def test_clipped_value_loss_by_hand():
    v, old, ret = [1.0, 0.0, 2.5, -1.0], [0.8, 0.5, 2.0, -1.0], [1.5, -1.0, 2.1, 0.0]
    got = losses.value_loss(t(v), t(old), t(ret), clip=0.2).tolist()
    want = []
    for vi, oi, ri in zip(v, old, ret):
        vc = oi + min(max(vi - oi, -0.2), 0.2)
        want.append(0.5 * max((vi - ri) ** 2, (vc - ri) ** 2))
    assert got == pytest.approx(want)
    # token 1: v - old = -0.5 is clipped to -0.2, so v_clip = 0.3; the max of (0 + 1)^2 = 1
    # and (0.3 + 1)^2 = 1.69 is the clipped branch
    assert got[1] == pytest.approx(0.5 * 1.69)
    assert losses.value_loss(t(v), t(old), t(ret), clip=None).tolist() == pytest.approx(
        [0.5 * (a - b) ** 2 for a, b in zip(v, ret)]
    )


def test_sft_cross_entropy_by_hand():
    assert float(
        losses.aggregate(losses.sft_loss(t(LOGP)), t(MASK), SEQ_IDS, "token-mean")
    ) == pytest.approx((1.0 + 0.5 + 0.2 + 1.5) / 4)


def test_first_step_ratio_exactly_one():
    out = losses.ppo_policy_loss(
        t(LOGP), t(LOGP), t(ADV), clip_low=0.2, clip_high=0.28, dual_clip=3.0
    )
    assert torch.equal(out.ratio, torch.ones(5, dtype=torch.float64))
    assert out.loss.tolist() == [-a for a in ADV]
    assert out.clipped.sum() == 0

"""The engine-vs-trainer mismatch metrics (`trainer.mismatch`) against their definitions, on
a batch whose loss masks hide tokens with a huge gap (tool output in a multi-turn trajectory):
those tokens must not move any metric."""

from __future__ import annotations

import math

import pytest
import torch

from trainer.config import LossConfig, RLBatch
from trainer.mismatch import lag_metrics, mismatch_metrics


def batch_with_hidden_tokens() -> tuple[RLBatch, list[list[float]]]:
    """Three sequences; the gaps (trainer - engine) of the loss-masked tokens are listed, the
    masked-out ones are 5.0 (|delta| far above every bound below)."""
    visible = [[0.05, -0.2, 0.0], [0.3, 1.0], [-0.01]]
    gaps, masks = [], []
    for v in visible:
        gaps.append(torch.tensor([5.0] + v + [5.0], dtype=torch.float64))
        masks.append(torch.tensor([0.0] + [1.0] * len(v) + [0.0]))
    engine = [torch.linspace(-3.0, -0.5, len(g), dtype=torch.float64) for g in gaps]
    old = [e + g for e, g in zip(engine, gaps)]
    tokens = [list(range(2 + len(g))) for g in gaps]
    return RLBatch(
        tokens=tokens,
        prompt_lens=[2] * 3,
        rollout_logprobs=engine,
        old_logprobs=old,
        loss_masks=masks,
    ), visible


@pytest.mark.parametrize("correction", [None, "tis", "mis"])
def test_metrics_equal_their_definitions_on_masked_tokens(correction):
    batch, visible = batch_with_hidden_tokens()
    cap, floor = 2.0, 0.9
    got = mismatch_metrics(batch, LossConfig(is_correction=correction, is_cap=cap, is_floor=floor))
    flat = [d for seq in visible for d in seq]
    n = len(flat)
    ratios = [math.exp(d) for d in flat]
    if correction == "tis":
        applied = [min(r, cap) for r in ratios]
    elif correction == "mis":
        applied = [r if floor <= r <= cap else 0.0 for r in ratios]
    else:
        applied = ratios
    want = {
        "logprob_diff_max": 1.0,
        "logprob_diff_mean": sum(abs(d) for d in flat) / n,
        "logprob_diff_large_frac": 3 / n,  # |delta| > 0.1: -0.2, 0.3, 1.0
        "logprob_diff_seq_mean_max": (0.3 + 1.0) / 2,
        "mismatch_kl": sum(r - 1 - d for r, d in zip(ratios, flat)) / n,
        "is_weight_mean": sum(applied) / n,
        "is_clipped_frac": sum(a != r for a, r in zip(applied, ratios)) / n,
    }
    assert got.keys() == want.keys()
    for key, value in want.items():
        assert got[key] == pytest.approx(value, abs=1e-12), key
    if correction is not None:
        assert got["is_clipped_frac"] > 0  # e^1.0 > 2 (and, for mis, e^-0.2 < 0.9)


def test_no_metrics_without_both_sides_or_tokens():
    batch, _ = batch_with_hidden_tokens()
    assert (
        mismatch_metrics(
            RLBatch(
                tokens=batch.tokens, prompt_lens=batch.prompt_lens, old_logprobs=batch.old_logprobs
            ),
            LossConfig(),
        )
        == {}
    )
    hidden = [torch.zeros_like(m) for m in batch.loss_masks]
    assert (
        mismatch_metrics(
            RLBatch(
                tokens=batch.tokens,
                prompt_lens=batch.prompt_lens,
                old_logprobs=batch.old_logprobs,
                rollout_logprobs=batch.rollout_logprobs,
                loss_masks=hidden,
            ),
            LossConfig(),
        )
        == {}
    )


def test_lag_metrics_split_the_gap():
    """engine -> (precision) -> trainer on the engine's weights -> (lag) -> trainer now."""
    batch, _ = batch_with_hidden_tokens()
    g = torch.Generator().manual_seed(3)
    sampling = [
        e + 0.01 * torch.randn(e.shape, generator=g, dtype=torch.float64)
        for e in batch.rollout_logprobs
    ]
    got = lag_metrics(batch, sampling)
    masks = torch.cat(batch.loss_masks) > 0
    engine, then = torch.cat(batch.rollout_logprobs)[masks], torch.cat(sampling)[masks]
    now = torch.cat(batch.old_logprobs)[masks]

    def k3(log_r):
        return float((log_r.exp() - 1 - log_r).mean())

    assert got["mismatch_kl_same_weights"] == pytest.approx(k3(then - engine), abs=1e-12)
    assert got["logprob_diff_max_same_weights"] == pytest.approx(
        float((then - engine).abs().max()), abs=1e-12
    )
    assert got["policy_lag_kl"] == pytest.approx(k3(now - then), abs=1e-12)
    assert got["mismatch_kl_same_weights"] < 1e-3 < got["policy_lag_kl"]

"""The first update of an on-policy rollout takes its old log-probs from its own forward.

No scoring pass: old = sg[lp], ratio = exp(lp - sg[lp]). Its value is exactly 1 and its
gradient is that of lp, so the step must equal (a) the same step given old log-probs from a
separate no-grad scoring pass (the path this replaces) and (b) the independent reference of
`test_optimizer_step_reference` (HF transformers, the loss written from the formulas, torch
AdamW) with old log-probs = the initial policy's. megatron in float64, DeepSpeed in float32
(its ZeRO masters are float32). PPO-KL is exactly 0, and the engine-vs-trainer metrics come
from the forward's log-probs. `train_policy` (several mini-batches of one rollout) scores the
later mini-batches before the first update: they must match a reference that scores the whole
batch first.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from exact_float64 import exact_float64
from test_optimizer_step_reference import (
    CASES,
    backend_config,
    make_batch,
    max_diff,
    reference_steps,
    response_logprobs_entropy,
)

from trainer import make_trainer
from trainer.mismatch import mismatch_metrics
from trainer.rl_updates import train_policy

from tiny_hf import make_hf_model, save_hf_model

BOUNDS = {"megatron": 1e-12, "deepspeed": 2e-5}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    # float32-representable float64 weights: both dtypes start from the same model
    model = make_hf_model("qwen2", seed=5).to(torch.float64)
    return save_hf_model(model, tmp_path_factory.mktemp("fused_qwen2"))


def engine_logprobs(initial):
    g = torch.Generator().manual_seed(3)
    return [lp + 0.3 * torch.randn(lp.shape, generator=g, dtype=torch.float64) for lp in initial]


def hf_initial(batch):
    hf = exact_float64(make_hf_model("qwen2", seed=5).to(torch.float64))
    with torch.no_grad():
        initial = [
            response_logprobs_entropy(hf, t, p)[0] for t, p in zip(batch.tokens, batch.prompt_lens)
        ]
    return hf, initial


@pytest.mark.parametrize("backend", ["megatron", "deepspeed"])
def test_first_update_equals_the_scored_path_and_the_reference(backend, model_dir):
    case = CASES["seq-mean-tis-clip"]  # TIS reads the old log-probs too
    batch = make_batch(97)
    hf, initial = hf_initial(batch)
    batch = dataclasses.replace(batch, rollout_logprobs=engine_logprobs(initial))
    ref_weights, ref_losses, ref_norms, _ = reference_steps(
        hf, dataclasses.replace(batch, old_logprobs=initial), case, steps=1
    )
    cfg = backend_config(model_dir, backend, case)

    fused = make_trainer(cfg)
    step = fused.train_step_scored(batch)  # batch.old_logprobs is None
    fused_weights = fused.hf_state_dict()
    scored = make_trainer(cfg)
    old = scored.compute_logprobs(batch)
    scored_metrics = scored.train_step(dataclasses.replace(batch, old_logprobs=old))
    scored_weights = scored.hf_state_dict()

    bound = BOUNDS[backend]
    m = step.metrics
    assert m["ppo_kl"] == 0.0 and m["ratio_max"] == 1.0 and m["clipfrac"] == 0.0
    assert max_diff(fused_weights, ref_weights[0]) <= bound
    assert m["loss"] == pytest.approx(ref_losses[0], abs=bound, rel=bound)
    assert m["grad_norm"] == pytest.approx(ref_norms[0], abs=bound, rel=bound)
    assert max_diff(fused_weights, scored_weights) <= bound
    assert m["grad_norm"] == pytest.approx(scored_metrics["grad_norm"], abs=bound, rel=bound)
    # the returned old log-probs are the forward's (the initial policy's) and the mismatch
    # metrics are theirs
    assert all(
        float((a.double() - b).abs().max()) <= bound for a, b in zip(step.old_logprobs, initial)
    )
    expected = mismatch_metrics(dataclasses.replace(batch, old_logprobs=initial), cfg.loss)
    assert expected and m["logprob_diff_max"] == pytest.approx(
        expected["logprob_diff_max"], abs=bound
    )
    assert m["is_weight_mean"] == pytest.approx(expected["is_weight_mean"], abs=bound)


def test_later_mini_batches_keep_the_weights_before_the_first_update(model_dir):
    """Two updates of one rollout: the second mini-batch's old log-probs are the initial
    weights', not the weights after the first update (float64, megatron)."""
    case = CASES["token-mean"]
    batch = make_batch(97)
    hf, initial = hf_initial(batch)
    batch = dataclasses.replace(batch, rollout_logprobs=engine_logprobs(initial))
    minis = [[0, 1], [2, 3]]
    cfg = backend_config(model_dir, "megatron", case)

    policy = make_trainer(cfg)
    got = train_policy(policy, batch, minis, off_policy=False)
    # reference: every sample scored before any update, then the two steps
    reference = make_trainer(cfg)
    complete = dataclasses.replace(batch, old_logprobs=reference.compute_logprobs(batch))
    want = [reference.train_step(complete.subset(idx)) for idx in minis]

    assert max_diff(policy.hf_state_dict(), reference.hf_state_dict()) <= 1e-12
    assert got["ppo_kl_first_update"] == 0.0
    assert want[1]["ppo_kl"] != 0.0  # the second update's old policy is not its weights
    for key in ("loss", "ppo_kl", "grad_norm", "ratio_mean", "kl"):
        assert got[key] == pytest.approx((want[0][key] + want[1][key]) / 2, abs=1e-12), key
    expected = mismatch_metrics(complete, cfg.loss)
    for key, value in expected.items():
        assert got[key] == pytest.approx(value, abs=1e-12), key

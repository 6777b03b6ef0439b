"""`model.dtype: float64`: the engine and the megatron trainer compute the same log-probs to
fp64 rounding, so the engine-vs-trainer gap (`train/logprob_diff_max`) measures pipeline bugs,
not float32 rounding.

Reference: HF transformers in float64 on the same weights, with its RMSNorms and rotary angles
computed in float64 too (HF computes those in float32 whatever the model dtype). The model is
sharpened (a scaled LM head, logits of tens) because that is where float32 rounding shows: the
float32 run of the same samples must miss the float64 reference by far more than the float64
run does, or this test could not tell the two dtypes apart.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from sharp_model import engine_samples, hf_reference, sharp_model, worst

from trainer import make_trainer
from trainer.config import LossConfig, OptimConfig, TrainerConfig


@pytest.fixture(scope="module", name="sharp_model")
def _sharp_model(tmp_path_factory):
    return sharp_model(tmp_path_factory.mktemp("sharp_qwen2"))


def test_float64_engine_and_trainer_agree_to_rounding(sharp_model):
    model, directory = sharp_model
    batch, engine64 = engine_samples(directory, "float64")
    ref = hf_reference(model, batch)
    assert min(float(r.min()) for r in ref) < -5.0  # unlikely tokens were sampled
    cfg = TrainerConfig(
        model_path=str(directory),
        dtype="float64",
        max_tokens_per_micro_batch=64,
        optim=OptimConfig(lr=1e-3),
        loss=LossConfig(policy_loss="ppo"),
    )
    trainer = make_trainer(cfg)
    trainer64 = trainer.compute_logprobs(batch)
    assert all(t.dtype == torch.float64 for t in trainer64)
    assert worst(engine64, ref) <= 1e-10
    assert worst(trainer64, ref) <= 1e-10
    assert worst(engine64, trainer64) <= 1e-10

    # the same samples scored in float32 on both sides: rounding is visible, so the bound
    # above is a property of float64, not of an easy model
    batch32, engine32 = engine_samples(directory, "float32")
    assert [list(t) for t in batch32.tokens] == [list(t) for t in batch.tokens]
    trainer32 = make_trainer(dataclasses.replace(cfg, dtype="float32")).compute_logprobs(batch)
    assert worst(engine32, ref) > 1e-8 and worst(trainer32, ref) > 1e-8

    # a float64 update: the first update's ratio is exactly 1 and the weights stay float64
    metrics = trainer.train_step(dataclasses.replace(batch, old_logprobs=trainer64))
    assert metrics["ppo_kl"] == 0.0 and metrics["ratio_max"] == 1.0
    assert all(t.dtype == torch.float64 for t in trainer.hf_state_dict().values())


def test_float64_needs_the_megatron_backend(tmp_path):
    with pytest.raises(ValueError, match="megatron"):
        TrainerConfig(model_path=str(tmp_path), backend="deepspeed", dtype="float64")

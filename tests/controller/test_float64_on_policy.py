"""`model.dtype: float64`: the engine and the megatron trainer compute the same log-probs to
fp64 rounding, so the engine-vs-trainer gap (`train/logprob_diff_max`) measures pipeline bugs,
not float32 rounding.

Reference: HF transformers in float64 on the same weights, with its RMSNorms and rotary angles
computed in float64 too (HF computes those in float32 whatever the model dtype). The model is sharpened (a scaled LM
head, logits of tens) because that is where float32 rounding shows: the float32 run of the same
samples must miss the float64 reference by far more than the float64 run does, or this test
could not tell the two dtypes apart.
"""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch
from exact_float64 import exact_float64
from tiny_hf import make_hf_model, save_hf_model

from rollout import Engine, EngineConfig, SamplingParams
from trainer import make_trainer
from trainer.config import LossConfig, OptimConfig, RLBatch, TrainerConfig


@pytest.fixture(scope="module")
def sharp_model(tmp_path_factory):
    model = make_hf_model("qwen2", seed=3, dtype=torch.float64)
    with torch.no_grad():
        model.lm_head.weight.mul_(4.0)
    directory = save_hf_model(model, tmp_path_factory.mktemp("sharp_qwen2"))
    return exact_float64(model), directory


def engine_samples(directory, dtype: str) -> tuple[RLBatch, list[torch.Tensor]]:
    rng = random.Random(5)
    prompts = [[rng.randrange(97) for _ in range(n)] for n in (4, 9, 15)]
    engine = Engine(EngineConfig(model_path=str(directory), dtype=dtype, kv_cache_tokens=512,
                                 page_size=4))
    outs = engine.generate(prompts, SamplingParams(n=4, temperature=1.0, max_new_tokens=12,
                                                   ignore_eos=True, seed=7))
    tokens, prompt_lens, logprobs = [], [], []
    for prompt, samples in zip(prompts, outs):
        for s in samples:
            tokens.append(prompt + list(s.token_ids))
            prompt_lens.append(len(prompt))
            logprobs.append(torch.tensor(s.logprobs, dtype=torch.float64))
    batch = RLBatch(tokens=tokens, prompt_lens=prompt_lens,
                    advantages=[torch.randn(len(t) - p) for t, p in zip(tokens, prompt_lens)],
                    rollout_logprobs=logprobs)
    return batch, logprobs


def hf_reference(model, batch: RLBatch) -> list[torch.Tensor]:
    out = []
    with torch.no_grad():
        for tokens, p in zip(batch.tokens, batch.prompt_lens):
            ids = torch.tensor([tokens])
            logp = model(ids).logits[0].double().log_softmax(-1)
            out.append(logp[p - 1:-1].gather(-1, ids[0, p:, None])[:, 0])
    return out


def worst(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max(float((x.double() - y.double()).abs().max()) for x, y in zip(a, b))


def test_float64_engine_and_trainer_agree_to_rounding(sharp_model):
    model, directory = sharp_model
    batch, engine64 = engine_samples(directory, "float64")
    ref = hf_reference(model, batch)
    assert min(float(r.min()) for r in ref) < -5.0       # unlikely tokens were sampled
    cfg = TrainerConfig(model_path=str(directory), dtype="float64", max_tokens_per_micro_batch=64,
                        optim=OptimConfig(lr=1e-3), loss=LossConfig(policy_loss="ppo"))
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

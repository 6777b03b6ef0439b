"""The DeepSpeed backend on a Hugging Face mixture of experts (`Qwen3MoeForCausalLM`, float32,
ZeRO-2, CPU): its log-probs equal HF's, its first PPO step equals the megatron backend's on the
same checkpoint and batch, and with `RLBatch.routed_experts` it replays the routes
(`trainer.hf_routing_replay`): the trainer's own routes change nothing and agree exactly, other
routes give HF's forward with its router forced to them (`test_routing_replay.ForcedHF`, float64)
and the agreement is the exact share of sets kept."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from test_routing_replay import ForcedHF, _changed_routes

import scenarios
from tiny_hf import make_hf_model, save_hf_model
from trainer_helpers import hf_response_logprobs, max_abs_diff


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    hf = make_hf_model("qwen3_moe")
    return hf, save_hf_model(hf, tmp_path_factory.mktemp("moe32"))


def _deepspeed(directory, **kw):
    from trainer.deepspeed_trainer import DeepSpeedTrainer

    return DeepSpeedTrainer(scenarios.trainer_config(directory, backend="deepspeed", **kw))


def test_deepspeed_mixture_equals_hf_and_its_step_the_megatron_backends(moe):
    from trainer.megatron_trainer import MegatronTrainer

    hf, directory = moe
    batch = scenarios.fixed_batch(hf.config.vocab_size)
    trainer = _deepspeed(directory)
    reference, _ = hf_response_logprobs(hf, batch.tokens, batch.prompt_lens)
    assert max_abs_diff(trainer.compute_logprobs(batch), reference) <= 1e-5
    metrics = trainer.train_step(batch)
    megatron = MegatronTrainer(scenarios.trainer_config(directory))
    want = megatron.train_step(batch)
    assert metrics["ratio_max"] == 1.0 and metrics["ppo_kl"] == 0.0
    assert metrics["loss"] == pytest.approx(want["loss"], abs=1e-6)
    assert metrics["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-5)
    after, mega_after = trainer.hf_state_dict(), megatron.hf_state_dict()
    assert sorted(after) == sorted(mega_after)
    assert max(float((after[n] - mega_after[n]).abs().max()) for n in after) <= 1e-5


def test_deepspeed_replays_routes_like_forced_hf(moe, tmp_path):
    hf, _ = moe
    hf64 = make_hf_model("qwen3_moe", dtype=torch.float64)
    directory = save_hf_model(hf64, tmp_path / "hf64")
    # lr 0: every step's agreement is against the same router
    lr0 = dataclasses.replace(scenarios.trainer_config(directory).optim, lr=0.0)
    trainer = _deepspeed(directory, optim=lr0)
    sparse = [
        i for i in range(hf64.config.num_hidden_layers) if i not in hf64.config.mlp_only_layers
    ]
    forced_hf = ForcedHF(hf64, sparse)
    batch = scenarios.fixed_batch(hf.config.vocab_size)
    free = trainer.compute_logprobs(batch)
    _, own = forced_hf.run(batch.tokens, batch.prompt_lens)

    with_own = dataclasses.replace(batch, routed_experts=own)
    for a, b in zip(trainer.compute_logprobs(with_own), free):
        assert torch.equal(a, b)
    assert trainer.train_step(with_own)["routing_agreement"] == 1.0

    routes, changed = _changed_routes(own, batch, hf64.config.num_experts)
    forced = dataclasses.replace(batch, routed_experts=routes)
    got = trainer.compute_logprobs(forced)
    want, _ = forced_hf.run(batch.tokens, batch.prompt_lens, routes)
    assert max_abs_diff(got, want) <= 1e-5
    assert max_abs_diff(got, free) > 1e-4  # the routes matter
    # every sparse layer routes every row with a route (no shared prompts, no row selection)
    replayed = len(sparse) * sum(len(t) - 1 for t in batch.tokens)
    agreement = trainer.train_step(forced)["routing_agreement"]
    assert agreement == pytest.approx(1 - changed / replayed, abs=1e-15)

"""Qwen3-MoE / Qwen2-MoE in megatron-core (one process, TP = PP = 1): built from the shared
`ModelSpec` (`trainer.megatron_moe`: megatron's top-k router, SequentialMLP experts, Qwen2-MoE's
gated shared expert, sparse and dense layers as HF's config says), loaded through the bridge from
HF's per-expert names, its forward equals HF's `Qwen3MoeForCausalLM` / `Qwen2MoeForCausalLM`
within 1e-10 in float64 (HF made float64 throughout by `exact_float64`, its routers' softmax
included), with the top-k renormalised and not, and the export gives back the checkpoint
bitwise."""

from __future__ import annotations

import pytest
import torch
from exact_float64 import exact_float64
from safetensors.torch import load_file

from model_spec import ModelSpec

import scenarios
from tiny_hf import make_hf_model, save_hf_model
from trainer_helpers import hf_response_logprobs, max_abs_diff


@pytest.mark.parametrize(
    "family,norm_topk_prob", [("qwen3_moe", True), ("qwen3_moe", False), ("qwen2_moe", False)]
)
def test_megatron_moe_forward_equals_hf_and_export_round_trips(family, norm_topk_prob, tmp_path):
    from trainer.bridge import HFCheckpoint, gather_hf_state_dict, load_hf_weights
    from trainer.megatron_model import build_gpt_model
    from trainer.parallel import init_parallel

    init_parallel(1, 1)
    hf = make_hf_model(family, dtype=torch.float64, norm_topk_prob=norm_topk_prob)
    directory = save_hf_model(hf, tmp_path / "hf")
    reference = exact_float64(hf)
    arch = ModelSpec.from_dir(directory)
    assert arch.moe is not None and len(arch.moe.sparse_layers) == 2
    model, layout = build_gpt_model(arch, params_dtype=torch.float64)
    load_hf_weights(model, arch, layout, HFCheckpoint(directory))
    model.eval()

    ids = torch.randint(0, arch.vocab_size, (2, 13), generator=torch.Generator().manual_seed(3))
    positions = torch.arange(13).expand(2, 13)
    with torch.no_grad():
        got = model(ids, positions, None)[..., : arch.vocab_size]
        want = reference(ids).logits
    assert float((got - want).abs().max()) <= 1e-10

    original = load_file(directory / "model.safetensors")
    exported = gather_hf_state_dict(model, arch, layout)
    assert sorted(exported) == sorted(original)
    for name, tensor in original.items():
        assert exported[name].dtype == tensor.dtype and torch.equal(exported[name], tensor), name


def test_the_megatron_trainer_trains_a_mixture(tmp_path):
    """The policy trainer on a Qwen3-MoE (float32): log-probs equal HF's within 1e-5; before the
    first update its recomputed old log-probs equal the training forward's (same routes), so
    the ratio is exactly 1 and the KL exactly 0; the step moves the router and the experts."""
    from trainer.megatron_trainer import MegatronTrainer

    hf = make_hf_model("qwen3_moe")
    directory = save_hf_model(hf, tmp_path / "hf")
    trainer = MegatronTrainer(scenarios.trainer_config(directory))
    batch = scenarios.fixed_batch(hf.config.vocab_size)
    reference, _ = hf_response_logprobs(hf, batch.tokens, batch.prompt_lens)
    assert max_abs_diff(trainer.compute_logprobs(batch), reference) <= 1e-5
    metrics = trainer.train_step(batch)
    assert metrics["ppo_kl"] == 0.0 and metrics["kl"] == 0.0 and metrics["ratio_max"] == 1.0
    before, after = load_file(directory / "model.safetensors"), trainer.hf_state_dict()
    for name in ("model.layers.0.mlp.gate.weight", "model.layers.2.mlp.experts.0.up_proj.weight"):
        assert float((after[name] - before[name]).abs().max()) > 1e-4, name

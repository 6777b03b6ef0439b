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


def _switch_loss(logits: torch.Tensor, k: int) -> torch.Tensor:
    """The switch load-balancing loss of one router over `logits` [tokens, experts], in closed
    form: E * sum_i f_i P_i, f_i the share of the top-k slots given to expert i, P_i the mean
    softmax probability of expert i."""
    tokens, experts = logits.shape
    probs = torch.softmax(logits, dim=-1)
    counts = torch.zeros(experts, dtype=logits.dtype)
    counts.index_add_(0, probs.topk(k, dim=-1).indices.flatten(), torch.ones(tokens * k).double())
    return experts * ((counts / (tokens * k)) * probs.mean(dim=0)).sum()


def test_load_balancing_loss_is_the_switch_loss_per_micro_batch(tmp_path):
    """`moe_aux_loss_coeff`: with a zero policy loss, each router's gradient is coeff x the
    gradient of its switch loss averaged over micro-batches, computed independently from HF's
    router logits (float64, each sample alone; samples grouped as the trainer packs them), and
    the reported value is that average over sparse layers."""
    from trainer.megatron_runner import MegatronModel
    from trainer.packing import pack_all
    from trainer.parallel import init_parallel

    init_parallel(1, 1)
    hf = make_hf_model("qwen3_moe", dtype=torch.float64)
    directory = save_hf_model(hf, tmp_path / "hf")
    reference = exact_float64(hf)
    coeff = 0.25
    cfg = scenarios.trainer_config(
        directory, dtype="float64", share_prompts=False, moe_aux_loss_coeff=coeff
    )
    policy = MegatronModel(cfg, trainable=True)
    batch = scenarios.fixed_batch(hf.config.vocab_size)
    mbs = pack_all(batch.tokens, batch.prompt_lens, cfg.max_tokens_per_micro_batch, False)
    assert len(mbs) >= 2

    def zero_loss(mb, logits):
        return (logits * 0).sum(), torch.tensor(1), {}

    policy.train_micro_batches(batch, zero_loss)

    per_sample = [reference(torch.tensor([t]), output_router_logits=True) for t in batch.tokens]
    k, layers = hf.config.num_experts_per_tok, len(per_sample[0].router_logits)

    def layer_logits(mb, layer):
        return torch.cat([per_sample[i].router_logits[layer] for i in mb.sample_indices])

    # per sparse layer, the mean over micro-batches
    losses = torch.stack(
        [torch.stack([_switch_loss(layer_logits(mb, j), k) for j in range(layers)]) for mb in mbs]
    ).mean(dim=0)
    (coeff * losses.sum()).backward()
    # megatron tracks the value in float32
    assert abs(policy.aux_loss() - float(losses.detach().mean())) <= 1e-6
    sparse = [i for i in range(hf.config.num_hidden_layers) if i not in hf.config.mlp_only_layers]
    assert len(sparse) == layers == 2
    params = dict(policy.raw.named_parameters())
    for i in sparse:
        got = params[f"decoder.layers.{i}.mlp.router.weight"].main_grad
        want = reference.model.layers[i].mlp.gate.weight.grad
        assert float(want.abs().max()) > 1e-6
        assert float((got - want).abs().max()) <= 1e-12, i


def test_the_trainer_reports_the_load_balancing_loss_only_when_on(tmp_path):
    from trainer.megatron_trainer import MegatronTrainer

    hf = make_hf_model("qwen3_moe")
    directory = save_hf_model(hf, tmp_path / "hf")
    batch = scenarios.fixed_batch(hf.config.vocab_size)
    off = MegatronTrainer(scenarios.trainer_config(directory)).train_step(batch)
    assert "moe_aux_loss" not in off
    on = MegatronTrainer(scenarios.trainer_config(directory, moe_aux_loss_coeff=0.01))
    # E * sum_i f_i P_i <= E * max_i P_i <= E
    assert 0.0 < on.train_step(batch)["moe_aux_loss"] <= hf.config.num_experts

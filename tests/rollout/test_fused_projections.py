"""Fused q/k/v and gate/up projections (`CausalLM.fuse_projections`) against the separate
projections they replace, on the same weights, in one process, float64:

* qwen2 (q/k/v biases, q and k rotated together), qwen3 (q/k-norm: rotated apart, no biases)
  and llama: greedy and seeded sampled tokens equal, log-probs within 1e-12;
* the parameters are views of the fused tensors, so a weight update (in-place copies) moves
  the fused engine's outputs with the reference's;
* after `release_memory(weights=True)` the fused tensors hold no storage (the memory is really
  released), and after `resume_memory` + a full update the outputs agree again.

The reference is the same engine class with each layer's fused tensors set to None, which is
the separate-projection code path (nn.Linear per projection, rotary on q and k apart).
"""

import itertools

import pytest
import torch

from rollout import Engine, EngineConfig, SamplingParams


def unfused(engine: Engine) -> Engine:
    for layer in engine.model.model.layers:
        layer.self_attn.qkv_weight = layer.self_attn.qkv_bias = None
        layer.mlp.gate_up_weight = layer.mlp.gate_up_bias = None
    return engine


def prompts_for(vocab: int, count: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randint(0, vocab, (int(n),), generator=g).tolist()
        for n in torch.randint(1, 24, (count,), generator=g)
    ]


def perturbed(engine: Engine, seed: int):
    g = torch.Generator().manual_seed(seed)
    return [
        (name, p.detach() + 0.05 * torch.randn(p.shape, generator=g, dtype=p.dtype))
        for name, p in engine.model.named_parameters()
    ]


def fused_tensors(engine: Engine) -> list[torch.Tensor]:
    out = []
    for layer in engine.model.model.layers:
        out += [layer.self_attn.qkv_weight, layer.mlp.gate_up_weight]
        out += [t for t in (layer.self_attn.qkv_bias, layer.mlp.gate_up_bias) if t is not None]
    return out


@pytest.mark.parametrize("family", ["qwen2", "qwen3", "llama"])
def test_fused_projections_equal_separate(tiny_hf_checkpoints, family):
    model, directory = tiny_hf_checkpoints(family)
    prompts = prompts_for(model.config.vocab_size, 4)
    config = dict(model_path=str(directory), page_size=4, max_model_len=96, dtype="float64")
    fused = Engine(EngineConfig(**config))
    reference = unfused(Engine(EngineConfig(**config)))
    greedy = SamplingParams(n=3, temperature=0.0, max_new_tokens=12, ignore_eos=True)
    sampled = SamplingParams(n=3, temperature=1.0, max_new_tokens=12, ignore_eos=True, seed=7)

    attn = fused.model.model.layers[0].self_attn
    assert attn.q_proj.weight.data_ptr() == attn.qkv_weight.data_ptr()  # a view, not a copy
    assert (attn.qkv_bias is not None) == (family == "qwen2")

    def check() -> list[int]:
        for params in (greedy, sampled):
            for a, b in zip(
                itertools.chain(*reference.generate(prompts, params)),
                itertools.chain(*fused.generate(prompts, params)),
            ):
                assert a.token_ids == b.token_ids
                assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) <= 1e-12
        fused.check_integrity()
        return fused.generate(prompts[:1], greedy)[0][0].token_ids

    before = check()
    update = perturbed(fused, seed=1)
    for engine in (reference, fused):
        engine.update_weights(update)
    assert check() != before  # the update reached the fused tensors

    update = perturbed(fused, seed=2)
    for engine in (reference, fused):
        engine.release_memory(weights=True)
    assert all(t.numel() == 0 for t in fused_tensors(fused))
    for engine in (reference, fused):
        engine.resume_memory()
        engine.update_weights(update)
    unfused(reference)  # resume re-fused the reference's new storage
    assert attn.q_proj.weight.data_ptr() == attn.qkv_weight.data_ptr()
    check()

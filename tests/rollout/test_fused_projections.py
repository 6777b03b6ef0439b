"""Fused q/k/v and gate/up projections (`CausalLM.fuse_projections`) against the separate
projections they replace, on the same weights, in one process, float64:

* qwen2 (q/k/v biases, q and k rotated together), qwen3 (q/k-norm: rotated apart, no biases)
  and llama: greedy and seeded sampled tokens equal, log-probs within 1e-12;
* the parameters are views of the fused tensors, so a weight update (in-place copies) moves
  the fused engine's outputs with the reference's;
* after `release_memory(weights=True)` the fused tensors hold no storage (the memory is really
  released), and after `resume_memory` + a full update the outputs agree again;
* the engine stores linear weights row-major (HF's layout) by default; one set to
  column-major (`CausalLM.column_major`) keeps that layout after a release / resume, and gives
  the same tokens as the row-major engine on the same weights.

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


def linear_weights(engine: Engine) -> list[torch.Tensor]:
    model = engine.model
    out = [model.lm_head.weight] if not model.config.tie_word_embeddings else []
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        out += [attn.qkv_weight, attn.o_proj.weight, mlp.gate_up_weight, mlp.down_proj.weight]
        out += [p.weight for p in (attn.q_proj, attn.k_proj, attn.v_proj, mlp.gate_proj)]
    return out


def column_major(engine: Engine) -> bool:
    """Every linear weight [out, in] has its `out` elements adjacent in memory (a fused
    projection's parameters are column blocks of the fused [in, out] tensor)."""
    return all(w.stride(0) == 1 and w.stride(1) >= w.shape[0] for w in linear_weights(engine))


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
    assert all(w.stride(1) == 1 for w in linear_weights(fused))  # row-major by default
    fused.model.column_major = True  # the other layout must survive release / resume too
    fused.model.fuse_projections()
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
    assert column_major(fused)
    check()


@pytest.mark.parametrize("family", ["qwen2", "llama"])
def test_column_major_weights_equal_row_major(tiny_hf_checkpoints, family):
    """An engine's column-major linear weights against the same engine laid out row-major
    (HF's layout): same values, same tokens, log-probs within 1e-12 (float64; the two layouts
    sum the products in other orders)."""
    model, directory = tiny_hf_checkpoints(family)
    config = dict(model_path=str(directory), page_size=4, max_model_len=96, dtype="float64")
    engine, row_major = Engine(EngineConfig(**config)), Engine(EngineConfig(**config))
    engine.model.column_major = True
    engine.model.fuse_projections()
    assert column_major(engine)
    assert all(w.stride(1) == 1 for w in linear_weights(row_major))
    params = dict(row_major.model.named_parameters())
    for name, p in engine.model.named_parameters():
        assert torch.equal(p, params[name]), name
    prompts = prompts_for(model.config.vocab_size, 4)
    sampled = SamplingParams(n=3, temperature=1.0, max_new_tokens=12, ignore_eos=True, seed=3)
    for a, b in zip(
        itertools.chain(*row_major.generate(prompts, sampled)),
        itertools.chain(*engine.generate(prompts, sampled)),
    ):
        assert a.token_ids == b.token_ids
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) <= 1e-12

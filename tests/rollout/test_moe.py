"""The engine on mixtures of experts against Hugging Face transformers.

The tiny random-init `Qwen3MoeForCausalLM` / `Qwen2MoeForCausalLM` of `tests/tiny_hf.py`
(`MOE_FAMILIES`: renormalised top-k and a dense layer between sparse ones; a shared expert and
plain top-k), saved with `save_pretrained` (per-expert names on disk), are loaded by HF and by the
engine. HF run teacher-forced over prompt + completion with `output_router_logits=True` is the
reference for every check:

* greedy tokens are HF's argmax at every step (every step is decisive: HF's top-1 / top-2 gap
  exceeds 100x the tolerance), log-probs within 1e-5 (float32) / 1e-10 (float64; HF made float64
  throughout by `exact_float64`, its routers' softmax included);
* `routed_experts` of each sample, [prompt + generated - 1, sparse layers, k], are the top-k of
  HF's router logits for every token (float32: every token whose k-th / (k+1)-th router-logit gap
  is decisive, at least 99% of them), for a cold prefill and for prefix-cache hits (the second
  call reuses every prompt's pages and returns the same routes bitwise), with forks that copy a
  partly filled page, under preemption, and after parked K/V is continued;
* weight updates by HF name (router and per-expert weights, a partial update of one expert
  too) give the outputs, routes included, of an engine built on the new weights;
* dense models return no routes; switches a mixture cannot take are refused in one line.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from moe_reference import (
    CASES,
    DTYPES,
    GREEDY,
    PROMPTS,
    assert_same,
    check_against_hf,
    make_checkpoints,
    run,
)
from safetensors.torch import load_file

from rollout import Engine, EngineConfig, SamplingParams

from tiny_hf import MOE_FAMILIES


@pytest.fixture(autouse=True)
def _one_torch_thread():
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict:
    return make_checkpoints(tmp_path_factory)


def make_engine(directory: str, dtype: str, **overrides) -> Engine:
    kwargs = dict(model_path=directory, dtype=dtype, kv_cache_tokens=512, page_size=4, seed=0)
    return Engine(EngineConfig(**(kwargs | overrides)))


@pytest.mark.parametrize("family,dtype", CASES)
def test_engine_equals_hf_cold_and_from_the_prefix_cache(family, dtype, checkpoints):
    hf_model, directory, _ = checkpoints[family, dtype]
    engine = make_engine(directory, dtype)
    cold = run(engine, PROMPTS, GREEDY)
    hits_before = engine.stats()["prefix_cache_hit_tokens"]
    for prompt, out in zip(PROMPTS, cold):
        check_against_hf(hf_model, prompt, out, dtype)
    # Again: every prompt's whole pages come from the cache, their routes from beside them.
    warm = run(engine, PROMPTS, GREEDY)
    assert all(out.cached_tokens >= 4 for out in warm)
    assert engine.stats()["prefix_cache_hit_tokens"] > hits_before
    assert_same(warm, cold, atol=DTYPES[dtype][1])
    for prompt, out in zip(PROMPTS, warm):
        check_against_hf(hf_model, prompt, out, dtype)


def test_routes_survive_preemption_and_parking(checkpoints):
    hf_model, directory, _ = checkpoints["qwen3_moe", "float64"]
    # 12 pages of 4 for 8 samples of up to 21 tokens: sequences are preempted and recomputed.
    engine = make_engine(directory, "float64", kv_cache_tokens=48, max_running_requests=8)
    outs = run(engine, PROMPTS, GREEDY)
    assert engine.stats()["preemptions"] > 0
    for prompt, out in zip(PROMPTS, outs):
        check_against_hf(hf_model, prompt, out, "float64")

    # A parked sample (aborted with park_kv) continued by a request for its tokens: the
    # continuation's routes cover the parked K/V's tokens too.
    engine = make_engine(directory, "float64")
    park = SamplingParams(temperature=0.0, max_new_tokens=12, ignore_eos=True, park_kv=True)
    request = engine.add_request(PROMPTS[0], park)
    for _ in range(5):
        engine.step()
    engine.abort(request)
    (aborted,) = engine.step()
    partial = aborted.samples[0]
    assert partial.finish_reason == "abort" and engine.stats()["parked_kv_tokens"] > 0
    routes = aborted.routed_experts[0]
    assert routes.shape[0] == len(PROMPTS[0]) + len(partial.token_ids) - 1
    continued_prompt = PROMPTS[0] + partial.token_ids
    (continued,) = run(engine, [continued_prompt], park)
    assert engine.stats()["parked_reused_tokens"] > 0
    assert torch.equal(continued.routed_experts[0][: routes.shape[0]], routes)
    check_against_hf(hf_model, continued_prompt, continued, "float64")


@pytest.mark.parametrize("family", list(MOE_FAMILIES))
def test_weight_updates_by_hf_name_reach_router_and_experts(family, checkpoints):
    _, directory, other = checkpoints[family, "float64"]
    new = load_file(str(Path(other) / "model.safetensors"))
    assert any(".mlp.experts.0.gate_proj.weight" in n for n in new)
    assert any(n.endswith(".mlp.gate.weight") for n in new)
    engine = make_engine(directory, "float64")
    before = run(engine, PROMPTS, GREEDY)
    engine.update_weights(new.items())
    assert_same(run(engine, PROMPTS, GREEDY), run(make_engine(other, "float64"), PROMPTS, GREEDY))

    # One expert's projection alone: outputs move only if some token is routed to it.
    old = load_file(str(Path(directory) / "model.safetensors"))
    engine.update_weights(old.items())
    assert_same(run(engine, PROMPTS, GREEDY), before)
    name = "model.layers.0.mlp.experts.1.up_proj.weight"
    engine.update_weights([(name, new[name])])
    after = run(engine, PROMPTS, GREEDY)
    used = any(bool((r[:, 0] == 1).any()) for out in before for r in out.routed_experts)
    changed = [s.logprobs for o in after for s in o.samples] != [
        s.logprobs for o in before for s in o.samples
    ]
    assert used and changed
    with pytest.raises(ValueError, match="the model expects"):
        engine.update_weights([(name, new[name][:, :-1])])


def test_dense_models_record_no_routes(tiny_hf_checkpoints):
    _, directory = tiny_hf_checkpoints("qwen3")
    (out,) = run(make_engine(str(directory), "float32"), [PROMPTS[0]], GREEDY)
    assert out.routed_experts is None


def test_switches_a_mixture_cannot_take_are_refused_in_one_line(checkpoints):
    _, directory, _ = checkpoints["qwen3_moe", "float32"]
    for field in ("decode_graphs", "compile"):
        with pytest.raises(ValueError, match=f"EngineConfig.{field}=True is not supported") as e:
            make_engine(directory, "float32", **{field: True})
        assert "\n" not in str(e.value)


def test_async_engine_results_carry_the_routes(checkpoints):
    from rollout.async_engine import AsyncEngine

    _, directory, _ = checkpoints["qwen2_moe", "float64"]
    (reference,) = run(make_engine(directory, "float64"), [PROMPTS[0]], GREEDY)
    async_engine = AsyncEngine(make_engine(directory, "float64"))
    try:
        result = async_engine.submit(PROMPTS[0], GREEDY).result(timeout=120)
    finally:
        async_engine.close()
    assert len(result.routed_experts) == GREEDY.n
    for got, want in zip(result.routed_experts, reference.routed_experts, strict=True):
        assert torch.equal(got, want)

"""RL lifecycle details and user errors of the engine.

* `update_weights` copies in place: parameter storage addresses do not change;
* `release_memory(weights=True)` drops weights; generation refuses until every weight is back,
  then equals the engine before release;
* `flush_prefix_cache` empties the radix cache (refused while requests are in flight);
* linear RoPE scaling matches HF transformers (greedy tokens);
* each user error gives one clear message naming the field.
"""

import pytest
import torch
import transformers

from rollout import Engine, EngineConfig, SamplingParams
from rollout.weights import iter_safetensors

from tiny_hf import make_hf_model, save_hf_model

GREEDY = SamplingParams(temperature=0.0, max_new_tokens=8, ignore_eos=True)
PROMPTS = [[5, 9, 2, 7], [1, 2, 3, 4, 5, 6, 7, 8, 9]]


def test_update_weights_keeps_addresses(tiny_hf_checkpoints):
    _, directory = tiny_hf_checkpoints("qwen3")
    engine = Engine(EngineConfig(model_path=str(directory)))
    before = {n: p.data_ptr() for n, p in engine.model.named_parameters()}
    new = {n: t * 1.01 for n, t in iter_safetensors(directory)}
    engine.update_weights(new.items())
    assert {n: p.data_ptr() for n, p in engine.model.named_parameters()} == before
    torch.testing.assert_close(
        engine.model.model.embed_tokens.weight, new["model.embed_tokens.weight"], rtol=0, atol=0
    )
    assert engine.weight_version == 1


def test_release_weights_then_update_restores_outputs(tiny_hf_checkpoints):
    _, directory = tiny_hf_checkpoints("qwen2")
    engine = Engine(EngineConfig(model_path=str(directory)))
    expected = engine.generate(PROMPTS, GREEDY)
    assert engine.release_memory(weights=True) > 0
    with pytest.raises(RuntimeError, match="resume_memory"):
        engine.generate(PROMPTS, GREEDY)
    engine.resume_memory()
    weights = list(iter_safetensors(directory))
    engine.update_weights(weights[:3])  # a partial bucket is not enough
    with pytest.raises(RuntimeError, match="update_weights"):
        engine.generate(PROMPTS, GREEDY)
    engine.update_weights(weights[3:])
    assert engine.generate(PROMPTS, GREEDY) == expected


def test_flush_prefix_cache_empties_it_and_keeps_outputs(tiny_hf_checkpoints):
    """A flushed engine generates what a fresh one does (what resumed runs rely on)."""
    _, directory = tiny_hf_checkpoints("qwen2")
    engine = Engine(EngineConfig(model_path=str(directory), page_size=2))
    sampled = SamplingParams(n=2, max_new_tokens=6, seed=3)
    first = engine.generate(PROMPTS, sampled)
    assert engine.stats()["prefix_cache_tokens"] > 0
    assert engine.flush_prefix_cache() > 0
    assert engine.stats()["prefix_cache_tokens"] == 0
    assert engine.generate(PROMPTS, sampled) == first
    engine.add_request(PROMPTS[0], GREEDY)
    with pytest.raises(RuntimeError, match="in flight"):
        engine.flush_prefix_cache()


def test_linear_rope_scaling_matches_hf(tmp_path):
    hf = make_hf_model(
        "qwen2", rope_parameters=dict(rope_type="linear", rope_theta=10000.0, factor=4.0)
    )
    save_hf_model(hf, tmp_path)
    engine = Engine(EngineConfig(model_path=str(tmp_path)))
    outs = engine.generate(PROMPTS, GREEDY)
    for prompt, samples in zip(PROMPTS, outs):
        gc = transformers.GenerationConfig(
            do_sample=False, max_new_tokens=8, eos_token_id=[], pad_token_id=0
        )
        ref = hf.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            generation_config=gc,
        )[0, len(prompt) :].tolist()
        assert samples[0].token_ids == ref


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(dtype="fp8"), "dtype"),
        (dict(page_size=0), "page_size"),
        (dict(kv_cache_tokens=-5), "kv_cache_tokens"),
        (dict(max_prefill_tokens=0), "max_prefill_tokens"),
        (dict(attention_backend="flash"), "attention_backend"),
    ],
)
def test_engine_config_errors_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=f"EngineConfig.{field}"):
        EngineConfig(model_path="/nowhere", **kwargs)


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(n=0), "n"),
        (dict(temperature=-1.0), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_k=-2), "top_k"),
        (dict(min_p=1.0), "min_p"),
        (dict(max_new_tokens=0), "max_new_tokens"),
        (dict(stop_token_ids=[-1]), "stop_token_ids"),
    ],
)
def test_sampling_params_errors_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=f"SamplingParams.{field}"):
        SamplingParams(**kwargs)


def test_request_errors(tiny_hf_checkpoints, tmp_path):
    _, directory = tiny_hf_checkpoints("llama")
    with pytest.raises(FileNotFoundError, match="model_path"):
        Engine(EngineConfig(model_path=str(tmp_path / "missing")))
    engine = Engine(
        EngineConfig(model_path=str(directory), kv_cache_tokens=64, max_running_requests=4)
    )
    with pytest.raises(ValueError, match="empty"):
        engine.add_request([], GREEDY)
    with pytest.raises(ValueError, match="vocabulary"):
        engine.add_request([10_000], GREEDY)
    with pytest.raises(ValueError, match="max_model_len"):
        engine.add_request([1] * 500, SamplingParams(max_new_tokens=100))
    with pytest.raises(ValueError, match="kv_cache_tokens"):
        engine.add_request([1] * 60, SamplingParams(max_new_tokens=10))
    with pytest.raises(ValueError, match="max_running_requests"):
        engine.add_request([1], SamplingParams(n=5, max_new_tokens=4))
    assert not engine.has_unfinished()


def test_engine_start_up_does_not_import_dynamo(tiny_hf_checkpoints):
    """A fresh engine process builds its model on the meta device; there, `nn.Embedding`'s
    initialisation and the rotary tables' ops are Python decompositions that import dynamo
    (seconds of CPU per engine process). Built and generating, it has not imported it."""
    import subprocess
    import sys
    from pathlib import Path

    _, directory = tiny_hf_checkpoints("qwen2")
    code = (
        "import sys\n"
        "from rollout import Engine, EngineConfig, SamplingParams\n"
        f"engine = Engine(EngineConfig(model_path={str(directory)!r}))\n"
        "engine.generate([[5, 9, 2, 7]], SamplingParams(temperature=0.0, max_new_tokens=4))\n"
        "print('torch._dynamo' in sys.modules)\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code],
        cwd=Path(__file__).resolve().parents[2],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split() == ["False"]

"""An FP8 KV cache under engine tensor parallelism: one Qwen2 replica over 2 CPU processes
(gloo), float32 model, `kv_cache_dtype="fp8_e4m3"`.

Every rank calibrates its own KV heads' scales, together (the calibration forward runs the TP
layers' collectives), at start, after a weight update and after release / resume. Checked:
* rank 0's scales equal its heads' share of a TP=1 engine's, bitwise, at every stage;
* every log-prob of TP=2's samples (greedy with n=2 forks over shared prefixes, and seeded
  sampling) equals Hugging Face's forward over the same tokens with K/V quantized ->
  dequantized with TP=1's scales (both ranks' heads: a wrong or NaN scale on rank 1 shows), to
  the FP8 rounding tolerance of `test_fp8_kv_cache`;
* after updating to another model's weights the scales and outputs follow, and back.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from test_fp8_kv_cache import LOGPROB_ATOL, hf_logprobs
from two_ranks import join_world, run_two_ranks

from rollout import Engine, EngineConfig, SamplingParams

from tiny_hf import make_hf_model, save_hf_model

PREFIX = [3, 17, 5, 29, 11, 7, 23]
PROMPTS = [PREFIX + [2, 41], PREFIX + [13], [43, 8, 61]]
GREEDY = SamplingParams(temperature=0.0, n=2, max_new_tokens=8, ignore_eos=True)
SAMPLED = SamplingParams(temperature=1.0, n=2, seed=11, max_new_tokens=8, ignore_eos=True)
DEADLINE_S = 600


def _config(directory: str, tp: int) -> EngineConfig:
    return EngineConfig(
        model_path=directory,
        dtype="float32",
        kv_cache_dtype="fp8_e4m3",
        kv_cache_tokens=512,
        page_size=4,
        tp=tp,
    )


def _outputs(engine: Engine, params) -> list[list[tuple[list[int], list[float]]]]:
    return [[(s.token_ids, s.logprobs) for s in out] for out in engine.generate(PROMPTS, params)]


def _scales(engine: Engine) -> tuple[torch.Tensor, torch.Tensor]:
    return engine.pool.k_scale.clone(), engine.pool.v_scale.clone()


def scenario(engine: Engine, directory: str, other: str) -> dict:
    result = {"scales": _scales(engine), "greedy": _outputs(engine, GREEDY)}
    result["sampled"] = _outputs(engine, SAMPLED)
    engine.update_weights(load_file(str(Path(other) / "model.safetensors")).items())
    result["updated_scales"], result["updated"] = _scales(engine), _outputs(engine, GREEDY)
    engine.release_memory(weights=True)
    engine.resume_weights()
    engine.update_weights(load_file(str(Path(directory) / "model.safetensors")).items())
    engine.alloc_kv()
    result["resumed_scales"], result["resumed"] = _scales(engine), _outputs(engine, GREEDY)
    return result


def _rank(rank: int, rendezvous: str, directory: str, other: str, out: str) -> None:
    import torch.distributed as dist

    from rollout.tp_follower import run_rank

    torch.set_num_threads(1)
    join_world(rank, rendezvous)
    engine = run_rank(_config(directory, tp=2))
    if engine is not None:
        result = scenario(engine, directory, other)
        engine.check_integrity()
        engine.close()
        torch.save(result, out)
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    hf = make_hf_model("qwen2", seed=0)
    other_hf = make_hf_model("qwen2", seed=1)
    directory = str(save_hf_model(hf, tmp_path_factory.mktemp("tp_fp8")))
    other = str(save_hf_model(other_hf, tmp_path_factory.mktemp("tp_fp8_other")))
    return hf, other_hf, directory, other


@pytest.fixture(scope="module")
def tp2(models, tmp_path_factory):
    _, _, directory, other = models
    out_dir = tmp_path_factory.mktemp("tp_fp8_out")
    out = str(out_dir / "rank0.pt")
    run_two_ranks(_rank, (directory, other, out), out_dir, DEADLINE_S)
    return torch.load(out)


def _worst(hf, scales, outputs) -> float:
    worst = 0.0
    for prompt, samples in zip(PROMPTS, outputs):
        for tokens, logprobs in samples:
            ref = hf_logprobs(hf, scales, prompt + list(tokens))[len(prompt) - 1 :]
            worst = max(
                worst, float((torch.tensor(logprobs, dtype=torch.float64) - ref).abs().max())
            )
    return worst


def test_tp2_fp8_scales_and_outputs(models, tp2):
    hf, other_hf, directory, other = models
    torch.set_num_threads(1)
    tp1 = scenario(Engine(_config(directory, tp=1)), directory, other)
    heads = tp2["scales"][0].shape[1]  # rank 0's KV heads: the first of TP=1's
    for key in ("scales", "updated_scales", "resumed_scales"):
        for got, want in zip(tp2[key], tp1[key]):
            assert torch.equal(got, want[:, :heads]), key
    assert torch.equal(tp1["resumed_scales"][0], tp1["scales"][0])
    for name, model, scales in (
        ("greedy", hf, tp1["scales"]),
        ("sampled", hf, tp1["scales"]),
        ("updated", other_hf, tp1["updated_scales"]),
        ("resumed", hf, tp1["resumed_scales"]),
    ):
        assert _worst(model, scales, tp2[name]) < LOGPROB_ATOL, name

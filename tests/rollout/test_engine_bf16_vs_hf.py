"""The engine in bfloat16 against Hugging Face transformers in bfloat16, on the same weights.

bf16 rounding makes exact agreement impossible, so two references:

* the truth: HF in exact float64 (`exact_float64`) on the bf16-rounded weights (what both bf16
  runs load). The engine's log-probs must be as close to it as HF's own bf16 forward is: mean
  |error| within 1.25x of HF's, max within 2x (measured: 0.96-1.03x and 1.06-1.35x);
* HF bf16 directly: |engine - HF| at most 0.08 per token and 0.02 on average (measured
  maximum 0.054 and mean 0.0135 over these cases: a 1.5x margin).

Sampled seeded at T = 1.0 and 0.7 (the log-probs are of logits / T), 256 tokens per case, on the
default-rope families (the truth's float64 rotary is the default one, so not llama3's). A
reference scored at a wrong temperature (10% off) breaks the direct bounds.
"""

from __future__ import annotations

import random

import pytest
import torch
import transformers
from exact_float64 import exact_float64

from rollout import Engine, EngineConfig, SamplingParams

from tiny_hf import make_hf_model, save_hf_model

MEAN_VS_HF, MAX_VS_HF = 0.02, 0.08
MEAN_RATIO, MAX_RATIO = 1.25, 2.0


@pytest.fixture(autouse=True)
def _one_torch_thread():
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@torch.inference_mode()
def response_logprobs(model, prompt: list[int], completion: list[int], temperature: float):
    seq = torch.tensor([prompt + completion])
    z = model(seq).logits[0, len(prompt) - 1 : -1].double() / temperature
    return torch.log_softmax(z, -1).gather(-1, torch.tensor(completion)[:, None])[:, 0]


def errors(got: list[torch.Tensor], ref: list[torch.Tensor]) -> tuple[float, float]:
    """(max, mean) of |got - ref| over all tokens."""
    flat = torch.cat([(g - r).abs() for g, r in zip(got, ref)])
    return float(flat.max()), float(flat.mean())


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("family", ["qwen2", "qwen3", "qwen2_head_dim_32"])
def test_bf16_engine_logprobs_as_close_as_hf_bf16(
    tiny_hf_checkpoints, tmp_path, family, temperature
):
    lengths = (5, 13, 22, 8)
    if family == "qwen2_head_dim_32":  # prefill on AMX tiles where the CPU has them (head dim
        # 32; prompts over several 64-key blocks): probabilities rounded to bfloat16
        directory = save_hf_model(make_hf_model("qwen2", hidden_size=128), tmp_path)
        lengths = (70, 13, 150, 8)
    else:
        _, directory = tiny_hf_checkpoints(family)
    hf_bf16 = transformers.AutoModelForCausalLM.from_pretrained(
        str(directory), dtype=torch.bfloat16
    ).eval()
    truth = exact_float64(
        transformers.AutoModelForCausalLM.from_pretrained(str(directory), dtype=torch.bfloat16)
        .to(torch.float64)
        .eval()
    )
    rng = random.Random(11)
    vocab = hf_bf16.config.vocab_size
    prompts = [[rng.randrange(vocab) for _ in range(n)] for n in lengths]
    engine = Engine(
        EngineConfig(model_path=str(directory), dtype="bfloat16", kv_cache_tokens=2048, page_size=4)
    )
    outs = engine.generate(
        prompts,
        SamplingParams(n=4, temperature=temperature, max_new_tokens=16, ignore_eos=True, seed=5),
    )
    pairs = [(p, list(s.token_ids)) for p, per_prompt in zip(prompts, outs) for s in per_prompt]
    got = [torch.tensor(s.logprobs, dtype=torch.float64) for per in outs for s in per]
    assert sum(len(g) for g in got) == 256
    ref_hf = [response_logprobs(hf_bf16, p, c, temperature) for p, c in pairs]
    ref_truth = [response_logprobs(truth, p, c, temperature) for p, c in pairs]

    engine_max, engine_mean = errors(got, ref_truth)
    hf_max, hf_mean = errors(ref_hf, ref_truth)
    assert engine_mean <= MEAN_RATIO * hf_mean, (engine_mean, hf_mean)
    assert engine_max <= MAX_RATIO * hf_max, (engine_max, hf_max)
    vs_max, vs_mean = errors(got, ref_hf)
    if family != "qwen2_head_dim_32":  # the direct bounds were measured on these two; the
        # wider model's bfloat16 runs differ more from each other (0.081-0.084 max at main's
        # float32 probabilities too): there the truth's ratios above are the bound
        assert vs_max <= MAX_VS_HF and vs_mean <= MEAN_VS_HF, (vs_max, vs_mean)

    wrong = [response_logprobs(hf_bf16, p, c, 1.1 * temperature) for p, c in pairs]
    wrong_max, wrong_mean = errors(got, wrong)
    assert wrong_max > MAX_VS_HF and wrong_mean > MEAN_VS_HF, (wrong_max, wrong_mean)

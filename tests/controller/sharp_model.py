"""The sharpened tiny Qwen2 of the dtype-fidelity tests, and samples from the engine on it.

A random-init Qwen2 with its LM head scaled by 4 (logits of tens): that is where rounding
shows, in float32 and far more in bfloat16, so the engine-vs-trainer log-prob gap measured on
it is a property of the dtype, not of an easy model.
"""

from __future__ import annotations

import random
from pathlib import Path

import torch
from exact_float64 import exact_float64

from rollout import Engine, EngineConfig, SamplingParams
from trainer.config import RLBatch

from tiny_hf import make_hf_model, save_hf_model


def sharp_model(directory: Path):
    """(HF model in exact float64, its checkpoint directory, saved in float64)."""
    model = make_hf_model("qwen2", seed=3, dtype=torch.float64)
    with torch.no_grad():
        model.lm_head.weight.mul_(4.0)
    return exact_float64(model), save_hf_model(model, directory)


def engine_samples(
    directory,
    dtype: str,
    *,
    prompt_lengths=(4, 9, 15),
    n: int = 4,
    max_new_tokens: int = 12,
    temperature: float = 1.0,
    seed: int = 7,
) -> tuple[RLBatch, list[torch.Tensor]]:
    """Seeded samples of the engine in `dtype` (random prompts, EOS ignored) as a batch with
    random advantages and the engine's log-probs, and those log-probs."""
    rng = random.Random(5)
    prompts = [[rng.randrange(97) for _ in range(k)] for k in prompt_lengths]
    engine = Engine(
        EngineConfig(model_path=str(directory), dtype=dtype, kv_cache_tokens=2048, page_size=4)
    )
    outs = engine.generate(
        prompts,
        SamplingParams(
            n=n, temperature=temperature, max_new_tokens=max_new_tokens, ignore_eos=True, seed=seed
        ),
    )
    tokens, prompt_lens, logprobs = [], [], []
    for prompt, samples in zip(prompts, outs):
        for s in samples:
            tokens.append(prompt + list(s.token_ids))
            prompt_lens.append(len(prompt))
            logprobs.append(torch.tensor(s.logprobs, dtype=torch.float64))
    g = torch.Generator().manual_seed(0)
    batch = RLBatch(
        tokens=tokens,
        prompt_lens=prompt_lens,
        advantages=[torch.randn(len(t) - p, generator=g) for t, p in zip(tokens, prompt_lens)],
        rollout_logprobs=logprobs,
    )
    return batch, logprobs


def hf_reference(model, batch: RLBatch, temperature: float = 1.0) -> list[torch.Tensor]:
    """`model`'s log-probs of every response token, log_softmax(logits / T), in float64."""
    out = []
    with torch.no_grad():
        for tokens, p in zip(batch.tokens, batch.prompt_lens):
            ids = torch.tensor([tokens])
            logp = (model(ids).logits[0].double() / temperature).log_softmax(-1)
            out.append(logp[p - 1 : -1].gather(-1, ids[0, p:, None])[:, 0])
    return out


def worst(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max(float((x.double() - y.double()).abs().max()) for x, y in zip(a, b))

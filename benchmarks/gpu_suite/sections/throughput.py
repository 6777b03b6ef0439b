"""Rollout throughput: the engine against HF transformers `generate` on the same weights.

A Qwen2.5-0.5B-shaped random model in bf16; GRPO-shaped workload: 8 prompts of 128 tokens,
n = 8, 128 new tokens, T = 1, EOS ignored. Each side runs once untimed (Triton compiles, graph
capture, HF's first kernels), then once timed. Figures only; the one check is that every
engine sample has its full length (so both sides generated the same number of tokens).
"""

from __future__ import annotations

import time

import torch

from benchmarks.gpu_suite import models


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def hf_generate_s(model, prompts, n: int, new_tokens: int, device) -> tuple[float, int]:
    ids = torch.tensor(prompts, device=device)
    kwargs = dict(
        attention_mask=torch.ones_like(ids),
        do_sample=True,
        num_return_sequences=n,
        top_k=0,
        top_p=1.0,
        temperature=1.0,
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        pad_token_id=0,
    )
    synchronize(device)
    start = time.perf_counter()
    out = model.generate(ids, **kwargs)
    synchronize(device)
    return time.perf_counter() - start, out.shape[0] * (out.shape[1] - ids.shape[1])


def run(ctx) -> dict:
    import transformers

    from rollout import Engine, EngineConfig, SamplingParams

    tiny = ctx.dry_run
    preset = "tiny" if tiny else "qwen0.5b"
    model_dir = models.checkpoint(ctx.workdir, preset, std=0.02, dtype="bfloat16")
    device = torch.device(ctx.device)
    count, length, n, new = (2, 16, 2, 8) if tiny else (8, 128, 8, 128)
    vocab = models.PRESETS[preset]["vocab_size"]
    prompts = models.random_prompts(vocab, count, length, length + 1, seed=6)

    engine = Engine(
        EngineConfig(
            model_path=model_dir,
            device=ctx.device,
            dtype="bfloat16",
            attention_backend="torch" if tiny else "triton",
            kv_cache_tokens=count * n * (length + new + 16),
            max_model_len=length + new + 16,
        )
    )
    params = SamplingParams(n=n, temperature=1.0, max_new_tokens=new, ignore_eos=True, seed=0)
    engine.generate(prompts, params)  # warm-up
    start = time.perf_counter()
    outs = engine.generate(prompts, params)
    engine_s = time.perf_counter() - start
    lengths = [len(s.token_ids) for per in outs for s in per]
    ctx.check("engine_samples_full_length", all(x == new for x in lengths), samples=len(lengths))
    engine_tokens = sum(lengths)
    engine.release_memory(weights=True)
    del engine
    if device.type == "cuda":
        torch.cuda.empty_cache()

    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16)
    hf = hf.to(device).eval()
    hf_generate_s(hf, prompts[:1], 1, 2, device)  # warm-up
    hf_s, hf_tokens = hf_generate_s(hf, prompts, n, new, device)
    return {
        "model": preset,
        "workload": {"prompts": count, "prompt_len": length, "n": n, "new_tokens": new},
        "engine_tokens_per_s": round(engine_tokens / engine_s, 1),
        "hf_tokens_per_s": round(hf_tokens / hf_s, 1),
        "engine_vs_hf": round((engine_tokens / engine_s) / (hf_tokens / hf_s), 2),
    }

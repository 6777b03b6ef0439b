"""`EngineConfig.compile` (inductor's Triton kernels, inside the decode graphs' CUDA graphs)
against the eager engine: float32, same weights, greedy, 12 prompts x 2 samples: tokens equal
and log-probs within 1e-4 (tests/rollout/test_compiled.py checks the same on CPU). Reports the
compiled engine's first rollout, compilation included. GPU only: inductor's CPU compile is the
CPU tests' business.
"""

from __future__ import annotations

import time

import torch

from benchmarks.gpu_suite import models

LOGPROB_TOL = 1e-4


def run(ctx) -> dict:
    from rollout import Engine, EngineConfig, SamplingParams
    from rollout.compiled import compiled_graphs

    torch.backends.cuda.matmul.allow_tf32 = False
    model_dir = models.checkpoint(ctx.workdir, "tiny", std=0.1)
    prompts = models.random_prompts(models.PRESETS["tiny"]["vocab_size"], 12, 4, 40, seed=8)
    params = SamplingParams(n=2, temperature=0.0, max_new_tokens=32, ignore_eos=True)
    runs = {}
    for compile_ in (False, True):
        engine = Engine(
            EngineConfig(
                model_path=model_dir,
                device=ctx.device,
                attention_backend="triton",
                max_model_len=256,
                kv_cache_tokens=8192,
                compile=compile_,
            )
        )
        start = time.perf_counter()
        samples = [s for per in engine.generate(prompts, params) for s in per]
        runs[compile_] = (samples, time.perf_counter() - start)
        engine.release_memory(weights=True)
    (eager, eager_s), (compiled, compiled_s) = runs[False], runs[True]
    same = sum(a.token_ids == b.token_ids for a, b in zip(eager, compiled))
    diff = max(abs(x - y) for a, b in zip(eager, compiled) for x, y in zip(a.logprobs, b.logprobs))
    ctx.check(
        "compiled_equals_eager",
        same == len(eager) and diff <= LOGPROB_TOL,
        identical_samples=same,
        samples=len(eager),
        max_logprob_diff=diff,
    )
    return {
        "compiled_graphs": compiled_graphs(),
        "eager_first_rollout_s": round(eager_s, 2),
        "compiled_first_rollout_s": round(compiled_s, 2),  # compilation included
    }

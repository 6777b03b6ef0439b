"""Speculative decoding: exact, then how fast.

Exactness (float32, a peaked model: weights of std 1.0, so no argmax is a near tie): greedy
samples with `group` and `draft` speculation (the draft: the target's first 2 layers)
equal those without, token for token, on the second of two rollouts of the same prompts (the
first gives `group` earlier completions to draft from); each method must have verified drafts,
or the comparison would be vacuous.

Speed (bf16, Qwen2.5-0.5B's shape, weights of std 1.0, one prompt x 8 samples at T = 1, 128
new tokens, the second rollout timed on a warm engine): tokens/s and accepted length of off,
`group` and `draft`.
"""

from __future__ import annotations

import dataclasses
import time

import torch

from benchmarks.gpu_suite import models

# `ngram` looks up drafts in the sequence itself, a subset of what `group` searches; a random
# model's outputs repeat no n-gram of its own, so `ngram` alone would verify nothing here.
METHODS = {
    "group": dict(speculative_method="group"),
    "draft": dict(speculative_method="draft"),
}
STAT_KEYS = ("generated_tokens", "spec_verify_steps", "spec_draft_tokens", "spec_accepted_tokens")
DRAFT_LAYERS = 2
LOGPROB_TOL = 1e-3  # float32: verification scores several tokens per row, decode one


def engine_for(model_dir, ctx, dtype, method, draft_dir, kv_tokens):
    from rollout import Engine, EngineConfig

    overrides = dict(METHODS.get(method, {}))
    if method == "draft":
        overrides["speculative_draft_model_path"] = draft_dir
    return Engine(
        EngineConfig(
            model_path=model_dir,
            device=ctx.device,
            dtype=dtype,
            attention_backend="torch" if ctx.dry_run else "triton",
            kv_cache_tokens=kv_tokens,
            max_model_len=512,
            speculative_ngram_min=2,
            **overrides,
        )
    )


def twice(engine, prompts, params):
    """Two rollouts of the same prompts, as in consecutive RL steps; the second's outputs, its
    seconds and its stats delta."""
    engine.generate(prompts, dataclasses.replace(params, seed=1))
    before = engine.stats()
    if engine.device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    outs = engine.generate(prompts, params)  # Python lists back: the device work is done
    seconds = time.perf_counter() - start
    after = engine.stats()
    delta = {k: after[k] - before[k] for k in STAT_KEYS}
    return outs, seconds, delta


def run(ctx) -> dict:
    from rollout import SamplingParams

    tiny = ctx.dry_run
    exact_preset = "tiny" if tiny else "hd128"
    exact_dir = models.checkpoint(ctx.workdir, exact_preset, std=1.0)
    exact_draft = models.layer_skip_draft(exact_dir, DRAFT_LAYERS)
    prompts = models.random_prompts(models.PRESETS[exact_preset]["vocab_size"], 4, 8, 24, seed=4)
    new_tokens = 16 if tiny else 64
    greedy = SamplingParams(n=4, temperature=0.0, max_new_tokens=new_tokens, ignore_eos=True)
    reference, _, _ = twice(
        engine_for(exact_dir, ctx, "float32", "off", exact_draft, 4096), prompts, greedy
    )
    for method in METHODS:
        outs, _, stats = twice(
            engine_for(exact_dir, ctx, "float32", method, exact_draft, 4096), prompts, greedy
        )
        pairs = [(a, b) for x, y in zip(outs, reference) for a, b in zip(x, y)]
        same = sum(a.token_ids == b.token_ids for a, b in pairs)
        diff = max(
            (
                abs(u - v)
                for a, b in pairs
                if a.token_ids == b.token_ids
                for u, v in zip(a.logprobs, b.logprobs)
            ),
            default=0.0,
        )
        ctx.check(
            f"greedy_equal_{method}",
            same == len(pairs) and diff <= LOGPROB_TOL and stats["spec_verify_steps"] > 0,
            identical_samples=same,
            samples=len(pairs),
            max_logprob_diff=diff,
            logprob_tol=LOGPROB_TOL,
            **stats,
        )

    speed_preset = "tiny" if tiny else "qwen0.5b"
    dtype = "float32" if tiny else "bfloat16"
    speed_dir = models.checkpoint(ctx.workdir, speed_preset, std=1.0, dtype=dtype)
    speed_draft = models.layer_skip_draft(speed_dir, DRAFT_LAYERS)
    vocab = models.PRESETS[speed_preset]["vocab_size"]
    prompt = models.random_prompts(vocab, 1, 128 if not tiny else 16, 129 if not tiny else 17, 5)
    sampled = SamplingParams(
        n=8, temperature=1.0, max_new_tokens=16 if tiny else 128, ignore_eos=True, seed=0
    )
    rows = {}
    for method in ("off", "group", "draft"):
        engine = engine_for(speed_dir, ctx, dtype, method, speed_draft, 8192)
        _, seconds, stats = twice(engine, prompt, sampled)
        row = {"seconds": round(seconds, 4), "tokens_per_s": stats["generated_tokens"] / seconds}
        if stats["spec_verify_steps"]:
            row["accepted_length"] = 1 + stats["spec_accepted_tokens"] / stats["spec_verify_steps"]
        rows[method] = row
        engine.release_memory(weights=True)
        del engine
    for row in rows.values():
        row["speedup"] = round(row["tokens_per_s"] / rows["off"]["tokens_per_s"], 3)
    return {"exactness_model": exact_preset, "speed_model": speed_preset, "speed": rows}

"""Prefill-decode disaggregation on one GPU without Ray: a prefill engine process and a decode
engine process, the handoffs (each prompt's K/V and its samples' first tokens) between them
through CUDA IPC (`miles_like.run.handoff_transport`, the engine actors' transport on one node;
shared memory on CPU).

Exactness (float32, TF32 off): the decode process samples what one engine samples for the same
seeds, tokens equal and log-probs within 1e-4 (tests/rollout/test_prefill_decode.py holds the
CPU to 1e-12 in float64), both cold and with the prefill engine's prefix hits; the K/V the
decode process opened are the prefill process's, bitwise (digests of the bytes on each side).

Figures (bf16): the handoff's bytes per prompt token, and the seconds and GB/s of the prefill
side's copy into the shared buffers and of the decode side's copy out of them, against the
prefill itself (what the transfer adds to a request's time to first token).
"""

from __future__ import annotations

import torch

from benchmarks.gpu_suite import models
from benchmarks.gpu_suite.peers import Peer

LOGPROB_TOL = 1e-4
WORKER = "benchmarks.gpu_suite.workers:PrefillDecodeWorker"


def _pair(model_dir: str, engine_kwargs: dict) -> tuple[Peer, Peer]:
    prefill = Peer(WORKER, model_dir, engine_kwargs, "prefill", name="prefill")
    decode = Peer(WORKER, model_dir, engine_kwargs, "decode", name="decode")
    prefill.ready()
    decode.ready()
    return prefill, decode


def _handoff(prefill: Peer, decode: Peer, prompts, params: dict):
    """One round: prefill and share, open and decode, release. (samples, prefill figures,
    decode figures)."""
    key, shared, sent = prefill.call("prefill", prompts, params)
    try:
        samples, received = decode.call("decode", shared, params)
    finally:
        prefill.call("release_handoffs", key)
    return samples, sent, received


def _compare(ctx, name: str, got, want, sent: dict, received: dict, **figures) -> None:
    pairs = [(a, b) for per_got, per_want in zip(got, want) for a, b in zip(per_got, per_want)]
    same = sum(a["token_ids"] == b["token_ids"] for a, b in pairs)
    diff = max(
        abs(x - y) for a, b in pairs for x, y in zip(a["logprobs"], b["logprobs"], strict=True)
    )
    ctx.check(
        name,
        same == len(pairs) and diff <= LOGPROB_TOL and sent["digests"] == received["digests"],
        identical_samples=same,
        samples=len(pairs),
        max_logprob_diff=diff,
        bound=LOGPROB_TOL,
        kv_bitwise=sent["digests"] == received["digests"],
        **figures,
    )


def exactness(ctx) -> None:
    torch.backends.cuda.matmul.allow_tf32 = False
    model_dir = models.checkpoint(ctx.workdir, "tiny", std=0.1)
    engine_kwargs = dict(
        device=ctx.device,
        dtype="float32",
        attention_backend="triton" if ctx.cuda else "torch",
        kv_cache_tokens=4096,
        max_model_len=128,
    )
    prompts = models.random_prompts(models.PRESETS["tiny"]["vocab_size"], 6, 8, 40, seed=11)
    params = dict(n=2, temperature=1.0, max_new_tokens=16, ignore_eos=True, seed=5)
    prefill, decode = _pair(model_dir, engine_kwargs)
    try:
        cold, sent, received = _handoff(prefill, decode, prompts, params)
        # one engine, the same seeds (the prefill engine: its cache now holds the prompts)
        want = prefill.call("generate", prompts, params)
        _compare(ctx, "pd_equals_one_engine_cold", cold, want, sent, received)
        hits, sent, received = _handoff(prefill, decode, prompts, params)
        _compare(
            ctx,
            "pd_equals_one_engine_with_prefix_hits",
            hits,
            want,
            sent,
            received,
            cached_tokens=sum(sent["cached_tokens"]),
        )
    finally:
        prefill.close()
        decode.close()


def transfer(ctx) -> dict:
    preset = "tiny" if ctx.dry_run else "hd128"
    model_dir = models.checkpoint(ctx.workdir, preset, dtype="bfloat16")
    count, length = (4, 64) if ctx.dry_run else (16, 1024)
    engine_kwargs = dict(
        device=ctx.device,
        dtype="bfloat16",
        attention_backend="triton" if ctx.cuda else "torch",
        kv_cache_tokens=count * (length + 64) * 2,
        max_model_len=length + 64,
    )
    prompts = models.random_prompts(models.PRESETS[preset]["vocab_size"], count, length, length + 1)
    params = dict(n=1, temperature=1.0, max_new_tokens=4, ignore_eos=True, seed=1)
    prefill, decode = _pair(model_dir, engine_kwargs)
    try:
        _handoff(prefill, decode, prompts[:1], params)  # warm-up: kernels, buffers
        _, sent, received = _handoff(prefill, decode, prompts, params)
    finally:
        prefill.close()
        decode.close()
    gigabytes = sent["bytes"] / 1e9
    return {
        "prompts": count,
        "prompt_tokens": length,
        "handoff_bytes": sent["bytes"],
        "bytes_per_prompt_token": sent["bytes"] / (count * length),
        "prefill_s": round(sent["prefill_s"], 4),
        "share_s": round(sent["share_s"], 4),
        "open_s": round(received["open_s"], 4),
        "share_gb_per_s": round(gigabytes / max(sent["share_s"], 1e-9), 2),
        "open_gb_per_s": round(gigabytes / max(received["open_s"], 1e-9), 2),
        "transfer_over_prefill": round(
            (sent["share_s"] + received["open_s"]) / max(sent["prefill_s"], 1e-9), 4
        ),
    }


def run(ctx) -> dict:
    exactness(ctx)
    return {"transfer": transfer(ctx)}

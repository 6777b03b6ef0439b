"""FP8 rollout weights (`EngineConfig.quantization="fp8"`) on the GPU: exact, then what it saves.

Exactness (float32, TF32 off, Triton attention): the FP8 engine equals a float32 engine running
the dequantized weights (`quantization.dequantize`), greedy tokens equal and log-probs within
1e-4 (tests/rollout/test_fp8_engine.py checks the same on CPU); its FP8 weights equal a fresh
quantization of the checkpoint's, bitwise (quantized on the GPU by the engine, on the host here).

Figures (bf16, the hd128 shape): a colocated weight push in process (CUDA buffers, wsum64
checksums), bytes and best-of-3 time, the sender quantizing for the FP8 engine against bf16;
greedy decode tokens/s at batch 32 of both engines (the FP8 engine dequantizes each linear
weight on the fly: no FP8 GEMM).
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from benchmarks.gpu_suite import models

LOGPROB_TOL = 1e-4


def _synchronize(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _dequantized_copy(model_dir: str) -> str:
    from safetensors.torch import load_file, save_file

    from quantization import dequantize, is_quantized_weight, quantize

    out = Path(model_dir + "-fp8-dequantized")
    if not (out / "config.json").exists():
        out.mkdir(parents=True, exist_ok=True)
        tensors = load_file(str(Path(model_dir) / "model.safetensors"))
        for name, t in tensors.items():
            if is_quantized_weight(name):
                tensors[name] = dequantize(*quantize(t), t.dtype)
        save_file(tensors, str(out / "model.safetensors"))
        (out / "config.json").write_text((Path(model_dir) / "config.json").read_text())
    return str(out)


def _engine(model_dir, ctx, dtype, quantization, kv_tokens, max_len):
    from rollout import Engine, EngineConfig

    return Engine(
        EngineConfig(
            model_path=model_dir,
            device=ctx.device,
            dtype=dtype,
            attention_backend="triton" if ctx.cuda else "torch",
            kv_cache_tokens=kv_tokens,
            max_model_len=max_len,
            quantization=quantization,
        )
    )


def exactness(ctx) -> None:
    from safetensors.torch import load_file

    from quantization import is_quantized_weight, quantize, scale_name
    from rollout import SamplingParams

    torch.backends.cuda.matmul.allow_tf32 = False
    model_dir = models.checkpoint(ctx.workdir, "tiny", std=0.1)
    prompts = models.random_prompts(models.PRESETS["tiny"]["vocab_size"], 8, 4, 40, seed=9)
    params = SamplingParams(temperature=0.0, max_new_tokens=24, ignore_eos=True)
    runs = {}
    for name, directory, quantization in (
        ("reference", _dequantized_copy(model_dir), None),
        ("fp8", model_dir, "fp8"),
    ):
        engine = _engine(directory, ctx, "float32", quantization, 4096, 128)
        runs[name] = [s for per in engine.generate(prompts, params) for s in per]
        if quantization:
            held = dict(engine.model.named_parameters())
            bitwise = all(
                held[n].cpu().view(torch.uint8).equal(q.weight.view(torch.uint8))
                and held[scale_name(n)].cpu().equal(q.scale_inv)
                for n, t in load_file(str(Path(model_dir) / "model.safetensors")).items()
                if is_quantized_weight(n)
                for q in (quantize(t),)
            )
            ctx.check("fp8_weights_are_the_checkpoints_quantized", bitwise)
        engine.release_memory(weights=True)
        del engine
    ref, fp8 = runs["reference"], runs["fp8"]
    same = sum(a.token_ids == b.token_ids for a, b in zip(ref, fp8))
    diff = max(abs(x - y) for a, b in zip(ref, fp8) for x, y in zip(a.logprobs, b.logprobs))
    ctx.check(
        "fp8_engine_equals_dequantized_weights",
        same == len(ref) and diff <= LOGPROB_TOL,
        identical_samples=same,
        samples=len(ref),
        max_logprob_diff=diff,
        bound=LOGPROB_TOL,
    )


def push(ctx, model_dir: str, quantization: str | None) -> dict:
    from rollout.weights import iter_safetensors
    from weight_sync import BucketReceiver, ColocatedSender, Done

    engine = _engine(model_dir, ctx, "bfloat16", quantization, 64, 64)
    weights = {n: t.to(ctx.device) + 0.001 for n, t in iter_safetensors(model_dir)}
    receiver = BucketReceiver(engine)
    sender = ColocatedSender(
        lambda h, m: Done(receiver.load(h, m)),
        bucket_bytes=256 << 20,
        device=ctx.device,
        quantization=quantization,
    )
    times = []
    for _ in range(3):
        _synchronize(ctx.device)
        start = time.perf_counter()
        report = sender.send(weights.items())
        receiver.commit()
        _synchronize(ctx.device)
        times.append(time.perf_counter() - start)
    sender.close()
    engine.release_memory(weights=True)
    return {"bytes": report.nbytes, "best_s": round(min(times[1:]), 4)}


def decode(ctx, model_dir: str, quantization: str | None, batch: int, new: int) -> float:
    from rollout import SamplingParams

    vocab = models.PRESETS["tiny" if ctx.dry_run else "hd128"]["vocab_size"]
    prompts = models.random_prompts(vocab, batch, 32, 33, seed=10)
    engine = _engine(model_dir, ctx, "bfloat16", quantization, batch * (new + 48), new + 48)
    params = SamplingParams(temperature=0.0, max_new_tokens=new, ignore_eos=True)
    engine.generate(prompts, params)  # warm-up: Triton compiles, graph capture
    _synchronize(ctx.device)
    start = time.perf_counter()
    engine.generate(prompts, params)
    _synchronize(ctx.device)
    elapsed = time.perf_counter() - start
    engine.release_memory(weights=True)
    return batch * new / elapsed


def run(ctx) -> dict:
    exactness(ctx)
    preset = "tiny" if ctx.dry_run else "hd128"
    model_dir = models.checkpoint(ctx.workdir, preset, dtype="bfloat16")
    sync = {name: push(ctx, model_dir, q) for name, q in (("bf16", None), ("fp8", "fp8"))}
    ctx.note(sync=sync)
    batch, new = (2, 8) if ctx.dry_run else (32, 64)
    tokens_per_s = {
        name: round(decode(ctx, model_dir, q, batch, new), 1)
        for name, q in (("bf16", None), ("fp8", "fp8"))
    }
    return {
        "sync": sync,
        "sync_bytes_fp8_over_bf16": round(sync["fp8"]["bytes"] / sync["bf16"]["bytes"], 4),
        "decode_tokens_per_s": tokens_per_s,
        "decode_fp8_over_bf16": round(tokens_per_s["fp8"] / tokens_per_s["bf16"], 3),
    }

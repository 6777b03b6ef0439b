"""The bf16 engine's log-probs against HF transformers on the same weights.

The engine (bf16, Triton attention, decode graphs) samples 8 prompts x 4 at T = 1 on a
Qwen2.5-0.5B-shaped model. The references score the same tokens (prompt + completion, one
forward each): HF in bf16, and the truth, HF in float32 (TF32 off) on the same bf16-rounded
weights. Stated bounds, as tests/rollout/test_engine_bf16_vs_hf.py on CPU: the engine's mean
|error| against the truth at most 1.25x HF bf16's own, its max at most 2x. A control shows
the comparison can fail: HF bf16 scored at a temperature 10% off must be further from the
engine than either bound allows.
"""

from __future__ import annotations

import torch

from benchmarks.gpu_suite import models

MEAN_RATIO, MAX_RATIO = 1.25, 2.0


@torch.inference_mode()
def response_logprobs(model, prompt, completion, temperature: float, device) -> torch.Tensor:
    ids = torch.tensor([prompt + completion], device=device)
    z = model(ids).logits[0, len(prompt) - 1 : -1].double() / temperature
    picked = torch.log_softmax(z, -1).gather(-1, torch.tensor(completion, device=device)[:, None])
    return picked[:, 0].cpu()


def errors(got: list[torch.Tensor], ref: list[torch.Tensor]) -> tuple[float, float]:
    flat = torch.cat([(g - r).abs() for g, r in zip(got, ref)])
    return float(flat.max()), float(flat.mean())


def run(ctx) -> dict:
    import transformers

    from rollout import Engine, EngineConfig, SamplingParams

    tiny = ctx.dry_run
    preset = "tiny" if tiny else "qwen0.5b"
    model_dir = models.checkpoint(ctx.workdir, preset, std=0.02, dtype="bfloat16")
    device = torch.device(ctx.device)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    prompts = models.random_prompts(models.PRESETS[preset]["vocab_size"], 8, 16, 64, seed=3)
    temperature = 1.0
    engine = Engine(
        EngineConfig(
            model_path=model_dir,
            device=ctx.device,
            dtype="bfloat16",
            attention_backend="torch" if tiny else "triton",
            kv_cache_tokens=8192,
            max_model_len=256,
        )
    )
    outs = engine.generate(
        prompts,
        SamplingParams(
            n=4, temperature=temperature, max_new_tokens=8 if tiny else 64, ignore_eos=True, seed=5
        ),
    )
    graphs = engine.decode_graphs.replays if engine.decode_graphs is not None else 0
    engine.release_memory(weights=True)
    del engine
    pairs = [(p, list(s.token_ids)) for p, per in zip(prompts, outs) for s in per]
    got = [torch.tensor(s.logprobs, dtype=torch.float64) for per in outs for s in per]

    def load(dtype):
        return transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)

    hf = load(torch.bfloat16).to(device).eval()
    ref_hf = [response_logprobs(hf, p, c, temperature, device) for p, c in pairs]
    wrong = [response_logprobs(hf, p, c, 1.1 * temperature, device) for p, c in pairs]
    del hf
    truth = load(torch.bfloat16).to(torch.float32).to(device).eval()
    ref_truth = [response_logprobs(truth, p, c, temperature, device) for p, c in pairs]
    del truth

    engine_max, engine_mean = errors(got, ref_truth)
    hf_max, hf_mean = errors(ref_hf, ref_truth)
    ctx.check(
        "engine_bf16_as_close_to_fp32_as_hf_bf16",
        engine_mean <= MEAN_RATIO * hf_mean and engine_max <= MAX_RATIO * hf_max,
        engine_mean_err=engine_mean,
        engine_max_err=engine_max,
        hf_bf16_mean_err=hf_mean,
        hf_bf16_max_err=hf_max,
        bound=f"mean <= {MEAN_RATIO} x HF's, max <= {MAX_RATIO} x HF's",
    )
    vs_max, vs_mean = errors(got, ref_hf)
    wrong_max, wrong_mean = errors(got, wrong)
    ctx.check(
        "control_wrong_temperature_detected",
        wrong_mean > MEAN_RATIO * max(hf_mean, vs_mean),
        wrong_mean_err=wrong_mean,
        wrong_max_err=wrong_max,
    )
    return {
        "model": preset,
        "tokens": sum(len(g) for g in got),
        "engine_vs_hf_bf16_max": vs_max,
        "engine_vs_hf_bf16_mean": vs_mean,
        "decode_graph_steps": graphs,
    }

"""Rollout throughput: our engine vs HF transformers `generate` on the same weights.

GRPO-shaped workload (issue 2): P prompts of L random tokens, n samples each, N new tokens,
temperature 1, EOS ignored. One process; torch uses all cores unless --threads says otherwise.
The same random-init Qwen2-architecture model is built with HF transformers, saved to a
temporary directory and loaded by the engine, so both sides compute the same function.

    .venv/bin/python benchmarks/rollout_throughput.py            # full run (minutes on 2 cores)
    .venv/bin/python benchmarks/rollout_throughput.py --quick    # seconds; used by a smoke test
    .venv/bin/python benchmarks/rollout_throughput.py --threads 1 --repeats 3  # on a shared machine

Prints one JSON object: generated tokens/s of HF, of the engine (radix cache on) and of the
engine with the radix cache off, the ratios to HF, the engine's stats over the timed call, and the
load average before and after (figures from a loaded machine mean little: see
benchmarks/RESULTS.md).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rollout.random_checkpoint import QWEN25_05B  # noqa: E402

STAT_KEYS = (
    "prefill_tokens_computed",
    "prefix_cache_hit_tokens",
    "generated_tokens",
    "decode_steps",
    "preemptions",
    "evicted_tokens",
)


def _shape_flags(hf_config: dict) -> dict:
    return dict(
        hidden_size=hf_config["hidden_size"],
        layers=hf_config["num_hidden_layers"],
        heads=hf_config["num_attention_heads"],
        kv_heads=hf_config["num_key_value_heads"],
        intermediate_size=hf_config["intermediate_size"],
        vocab_size=hf_config["vocab_size"],
    )


# Model shapes by name: the shape flags they set.
PRESETS = {"qwen2.5-0.5b": _shape_flags(QWEN25_05B)}


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--preset",
        choices=sorted(PRESETS),
        default=None,
        help="model shape preset (overrides the shape flags), e.g. qwen2.5-0.5b for the GPU suite",
    )
    ap.add_argument(
        "--device", default="cpu", help="cpu or cuda[:i]: where both HF and the engine run"
    )
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--hidden-size", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--intermediate-size", type=int, default=704)
    ap.add_argument("--vocab-size", type=int, default=4096)
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--n", type=int, default=8, help="samples per prompt")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument(
        "--threads", type=int, default=os.cpu_count(), help="torch threads (default: all cores)"
    )
    ap.add_argument(
        "--kv-cache-tokens",
        type=int,
        default=None,
        help="engine KV pool in tokens (default: room for every sample without sharing)",
    )
    ap.add_argument("--max-running-requests", type=int, default=256)
    ap.add_argument("--page-size", type=int, default=16, help="KV page size (the engine default)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--quick",
        action="store_true",
        help="scaled-down run (4 prompts of 32 tokens, n=4, 16 new tokens) for smoke tests",
    )
    ap.add_argument("--skip-hf", action="store_true", help="measure the engine only")
    ap.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="timed rounds, each running every system once (interleaved, so load from other "
        "processes hits all alike); the fastest round of each system is reported",
    )
    args = ap.parse_args(argv)
    for key, value in PRESETS.get(args.preset, {}).items():
        setattr(args, key, value)
    if args.quick:
        args.prompts, args.prompt_len, args.n, args.new_tokens = 4, 32, 4, 16
    return args


def build_model(args, directory: Path):
    import transformers

    config = transformers.Qwen2Config(
        hidden_size=args.hidden_size,
        intermediate_size=args.intermediate_size,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        vocab_size=args.vocab_size,
        max_position_embeddings=max(512, args.prompt_len + args.new_tokens + 64),
        rope_theta=10000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
    )
    torch.manual_seed(args.seed)
    model = transformers.AutoModelForCausalLM.from_config(
        config, dtype=getattr(torch, args.dtype)
    ).eval()
    model.save_pretrained(directory, safe_serialization=True)
    return model.to(args.device)


@torch.inference_mode()
def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_hf(model, prompts: list[list[int]], n: int, new_tokens: int) -> tuple[float, int]:
    ids = torch.tensor(prompts, device=model.device)
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
    _sync(model.device)
    t0 = time.perf_counter()
    out = model.generate(ids, **kwargs)
    _sync(model.device)
    seconds = time.perf_counter() - t0
    generated = out.shape[0] * (out.shape[1] - ids.shape[1])
    assert out.shape[0] == len(prompts) * n and out.shape[1] - ids.shape[1] == new_tokens, out.shape
    return seconds, generated


def run_engine(engine, prompts, params) -> tuple[float, int, dict, bool]:
    before = engine.stats()
    t0 = time.perf_counter()
    outs = engine.generate(prompts, params)
    seconds = time.perf_counter() - t0
    after = engine.stats()
    generated = sum(len(s.token_ids) for per_prompt in outs for s in per_prompt)
    full = all(
        len(s.token_ids) == params.max_new_tokens and s.finish_reason == "length"
        for per_prompt in outs
        for s in per_prompt
    ) and all(len(p) == params.n for p in outs)
    stats = {k: after[k] - before.get(k, 0) for k in after if isinstance(after[k], (int, float))}
    return seconds, generated, stats, full


def main(argv=None) -> dict:
    args = parse_args(argv)
    torch.set_num_threads(max(1, args.threads))
    import transformers

    from rollout import Engine, EngineConfig, SamplingParams

    g = torch.Generator().manual_seed(args.seed + 1)
    prompts = torch.randint(
        0, args.vocab_size, (args.prompts, args.prompt_len), generator=g
    ).tolist()
    warm = torch.randint(0, args.vocab_size, (2, args.prompt_len), generator=g).tolist()
    kv_tokens = (
        args.kv_cache_tokens or args.prompts * args.n * (args.prompt_len + args.new_tokens) + 1024
    )

    result: dict = {
        "workload": dict(
            prompts=args.prompts,
            prompt_len=args.prompt_len,
            n=args.n,
            new_tokens=args.new_tokens,
            temperature=1.0,
            ignore_eos=True,
            quick=args.quick,
        ),
        "model": dict(
            architecture="Qwen2ForCausalLM",
            hidden_size=args.hidden_size,
            layers=args.layers,
            heads=args.heads,
            kv_heads=args.kv_heads,
            intermediate_size=args.intermediate_size,
            vocab_size=args.vocab_size,
            dtype=args.dtype,
            preset=args.preset,
        ),
        "device": args.device,
        "threads": torch.get_num_threads(),
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
    }

    result["load_average_before"] = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        model = build_model(args, Path(tmp))
        if not args.skip_hf:
            run_hf(model, warm, 2, 4)  # warm-up

        params = SamplingParams(
            n=args.n,
            temperature=1.0,
            top_p=1.0,
            top_k=-1,
            max_new_tokens=args.new_tokens,
            ignore_eos=True,
        )
        engines = {}
        for key, radix in (("engine", True), ("engine_no_radix", False)):
            engines[key] = Engine(
                EngineConfig(
                    model_path=tmp,
                    device=args.device,
                    dtype=args.dtype,
                    kv_cache_tokens=kv_tokens,
                    page_size=args.page_size,
                    max_running_requests=args.max_running_requests,
                    enable_prefix_cache=radix,
                    seed=args.seed,
                )
            )
            run_engine(
                engines[key],
                warm,
                SamplingParams(n=2, temperature=1.0, max_new_tokens=4, ignore_eos=True),
            )

        for round_ in range(max(1, args.repeats)):
            if (
                round_
            ):  # fresh prompts: a later round must not find the earlier ones in the radix cache
                prompts = torch.randint(
                    0, args.vocab_size, (args.prompts, args.prompt_len), generator=g
                ).tolist()
            if not args.skip_hf:
                hf_s, hf_tokens = run_hf(model, prompts, args.n, args.new_tokens)
                if hf_s < result.get("hf_seconds", float("inf")):
                    result.update(
                        hf_seconds=hf_s,
                        hf_generated_tokens=hf_tokens,
                        hf_tokens_per_s=hf_tokens / hf_s,
                    )
            for key, engine in engines.items():
                seconds, generated, stats, full = run_engine(engine, prompts, params)
                if seconds < result.get(f"{key}_seconds", float("inf")):
                    result.update(
                        {
                            f"{key}_seconds": seconds,
                            f"{key}_generated_tokens": generated,
                            f"{key}_tokens_per_s": generated / seconds,
                            f"{key}_all_samples_full_length": full,
                            f"{key}_stats": {k: stats.get(k) for k in STAT_KEYS},
                        }
                    )
        if not args.skip_hf:
            for key in engines:
                result[f"ratio_{key}_vs_hf"] = (
                    result[f"{key}_tokens_per_s"] / result["hf_tokens_per_s"]
                )
        del model, engines
        result["kv_cache_tokens"] = kv_tokens
    result["repeats"] = max(1, args.repeats)
    result["load_average_after"] = os.getloadavg()
    return result


if __name__ == "__main__":
    out = main()
    json.dump(out, sys.stdout, indent=2)
    sys.stdout.write("\n")

"""Rollout throughput: our engine vs HF transformers `generate` on the same weights.

GRPO-shaped workload: P prompts of L random tokens, n samples each, N new tokens,
temperature 1, EOS ignored. One process; torch uses all cores unless --threads says otherwise.
The same random-init Qwen2-architecture model is built with HF transformers, saved to a
temporary directory and loaded by the engine, so both sides compute the same function.

    .venv/bin/python benchmarks/rollout_throughput.py            # full run (minutes on 2 cores)
    .venv/bin/python benchmarks/rollout_throughput.py --quick    # seconds; used by a smoke test
    .venv/bin/python benchmarks/rollout_throughput.py --threads 1 --repeats 3  # on a shared machine
    .venv/bin/python benchmarks/rollout_throughput.py --compile  # eager and compiled engines

Prints one JSON object: generated tokens/s of HF, of the engine (radix cache on) and of the
engine with the radix cache off, the ratios to HF, the engine's stats over the timed call, and the
load average before and after (figures from a loaded machine mean little: see
benchmarks/RESULTS.md).

Long-tailed lengths: `--lengths pareto:ALPHA` draws each prompt's length from a
Pareto distribution, L = min(new_tokens, floor(x_m / U^(1 / ALPHA))) with x_m = new_tokens / 8
(at least 1), and generates exactly L tokens for each of its samples (EOS ignored,
max_new_tokens = L). HF's static batch decodes every row to the longest drawn length; its
tokens/s counts only the drawn lengths (the useful tokens). For each engine the JSON also has
the timed call's tail (`_tail_s`: from 90% of the samples finished to the last), its share
(`_tail_frac`), the share of the call in forward passes (`_busy_frac`) and the time-weighted
batch occupancy over its peak (`_occupancy`), from the engine's activity log
(`miles_like.run.busy`).

    .venv/bin/python benchmarks/rollout_throughput.py --lengths pareto:1.2 --skip-hf
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import NamedTuple

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.run_record import RunRecord, add_output_args  # noqa: E402
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
        "--compile",
        action="store_true",
        help="also run both engines with EngineConfig.compile=True (keys engine_compiled, "
        "engine_no_radix_compiled; the warm-up's seconds, compilation included, are reported)",
    )
    ap.add_argument(
        "--lengths",
        default="fixed",
        type=_lengths_spec,
        help="fixed (every sample new_tokens long) or pareto:ALPHA (each prompt's length drawn "
        "from a Pareto distribution with shape ALPHA, capped at new_tokens)",
    )
    ap.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="timed rounds, each running every system once (interleaved, so load from other "
        "processes hits all alike); the fastest round of each system is reported",
    )
    add_output_args(ap)
    args = ap.parse_args(argv)
    for key, value in PRESETS.get(args.preset, {}).items():
        setattr(args, key, value)
    if args.quick:
        args.prompts, args.prompt_len, args.n, args.new_tokens = 4, 32, 4, 16
    return args


def _lengths_spec(text: str) -> str:
    if text == "fixed":
        return text
    kind, _, alpha = text.partition(":")
    try:
        ok = kind == "pareto" and float(alpha) > 0
    except ValueError:
        ok = False
    if not ok:
        raise argparse.ArgumentTypeError(
            f"--lengths {text!r}: use fixed or pareto:ALPHA with ALPHA > 0, e.g. pareto:1.2"
        )
    return text


def draw_lengths(spec: str, prompts: int, new_tokens: int, seed: int) -> list[int]:
    """Each prompt's number of new tokens (see the module docstring)."""
    if spec == "fixed":
        return [new_tokens] * prompts
    alpha = float(spec.partition(":")[2])
    x_m = max(1, new_tokens // 8)
    g = torch.Generator().manual_seed(seed + 2)
    u = 1.0 - torch.rand(prompts, generator=g, dtype=torch.float64)  # in (0, 1]
    return [min(new_tokens, int(x_m / float(v) ** (1.0 / alpha))) for v in u]


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
    """Seconds and generated tokens of one static batch, every row `new_tokens` long."""
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


class EngineRun(NamedTuple):
    seconds: float
    generated: int
    stats: dict
    full: bool  # every sample exactly its max_new_tokens long
    activity: dict  # miles_like.run.busy.rollout_metrics over the call


def run_engine(engine, prompts, params) -> EngineRun:
    from miles_like.run.busy import Span, rollout_metrics
    from rollout.activity import ActivityLog

    if not isinstance(params, list):
        params = [params] * len(prompts)
    before = engine.stats()
    engine.activity = ActivityLog()
    wall0, t0 = time.time(), time.perf_counter()
    outs = engine.generate(prompts, params)
    seconds, wall1 = time.perf_counter() - t0, time.time()
    after = engine.stats()
    generated = sum(len(s.token_ids) for per_prompt in outs for s in per_prompt)
    full = all(
        len(s.token_ids) == p.max_new_tokens and s.finish_reason == "length"
        for per_prompt, p in zip(outs, params)
        for s in per_prompt
    ) and all(len(o) == p.n for o, p in zip(outs, params))
    stats = {k: after[k] - before.get(k, 0) for k in after if isinstance(after[k], (int, float))}
    activity = rollout_metrics([engine.activity.take()], Span(wall0, wall1))
    engine.activity = None
    return EngineRun(seconds, generated, stats, full, activity)


def main(argv=None) -> dict:
    record = RunRecord.start("rollout_throughput", argv)
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
    lengths = draw_lengths(args.lengths, args.prompts, args.new_tokens, args.seed)

    result: dict = {
        "workload": dict(
            prompts=args.prompts,
            prompt_len=args.prompt_len,
            n=args.n,
            new_tokens=args.new_tokens,
            temperature=1.0,
            ignore_eos=True,
            quick=args.quick,
            lengths=args.lengths,
            drawn_lengths=lengths,
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

        params = [
            SamplingParams(
                n=args.n,
                temperature=1.0,
                top_p=1.0,
                top_k=-1,
                max_new_tokens=length,
                ignore_eos=True,
            )
            for length in lengths
        ]
        engines = {}
        systems = [("engine", True, False), ("engine_no_radix", False, False)]
        if args.compile:
            systems += [("engine_compiled", True, True), ("engine_no_radix_compiled", False, True)]
        for key, radix, compiled in systems:
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
                    compile=compiled,
                )
            )
            t0 = time.perf_counter()
            run_engine(
                engines[key],
                warm,
                SamplingParams(n=2, temperature=1.0, max_new_tokens=4, ignore_eos=True),
            )
            if compiled:  # the warm-up compiles every piece (dynamic shapes: once for any batch)
                result[f"{key}_warmup_s"] = time.perf_counter() - t0
        if args.compile:
            from rollout.compiled import compiled_graphs

            result["compiled_graphs_after_warmup"] = compiled_graphs()

        for round_ in range(max(1, args.repeats)):
            if (
                round_
            ):  # fresh prompts: a later round must not find the earlier ones in the radix cache
                prompts = torch.randint(
                    0, args.vocab_size, (args.prompts, args.prompt_len), generator=g
                ).tolist()
            if not args.skip_hf:
                # a static batch decodes every row to the longest; only drawn lengths count
                hf_s, _ = run_hf(model, prompts, args.n, max(lengths))
                hf_tokens = args.n * sum(lengths)
                if hf_s < result.get("hf_seconds", float("inf")):
                    result.update(
                        hf_seconds=hf_s,
                        hf_generated_tokens=hf_tokens,
                        hf_tokens_per_s=hf_tokens / hf_s,
                    )
            for key, engine in engines.items():
                r = run_engine(engine, prompts, params)
                if r.seconds < result.get(f"{key}_seconds", float("inf")):
                    result.update(
                        {
                            f"{key}_seconds": r.seconds,
                            f"{key}_generated_tokens": r.generated,
                            f"{key}_tokens_per_s": r.generated / r.seconds,
                            f"{key}_all_samples_full_length": r.full,
                            f"{key}_stats": {k: r.stats.get(k) for k in STAT_KEYS},
                            f"{key}_tail_s": r.activity["rollout_tail_s"],
                            f"{key}_tail_frac": r.activity["rollout_tail_frac"],
                            f"{key}_busy_frac": r.activity["engine_busy_frac"],
                            f"{key}_occupancy": r.activity["engine_occupancy"],
                        }
                    )
        if args.compile:
            result["compiled_graphs_at_end"] = compiled_graphs()
        if not args.skip_hf:
            for key in engines:
                result[f"ratio_{key}_vs_hf"] = (
                    result[f"{key}_tokens_per_s"] / result["hf_tokens_per_s"]
                )
        del model, engines
        result["kv_cache_tokens"] = kv_tokens
    result["repeats"] = max(1, args.repeats)
    result["load_average_after"] = os.getloadavg()
    record.finish(result, args)
    return result


if __name__ == "__main__":
    # stdout is the JSON alone: libraries' log lines (deepspeed's accelerator notice, which HF
    # generate triggers) go to stderr
    with contextlib.redirect_stdout(sys.stderr):
        out = main()
    json.dump(out, sys.stdout, indent=2)
    sys.stdout.write("\n")

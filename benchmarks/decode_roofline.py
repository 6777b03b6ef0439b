"""Decode step time against the memory roofline: how close one engine decode step comes to the
time it takes just to read what it must read.

A decode step of B sequences must read every weight once (the LM head included; the embedding
only if tied, since a lookup reads B rows) and every sequence's K/V once:
    roofline_s = (weight bytes + K/V bytes) / peak memory bandwidth.
The engine is brought to a steady state where all B sequences decode (distinct random prompts, so
no K/V is shared), then `--steps` whole `Engine.step()` calls are timed: scheduling, attention,
sampling and Python overhead included, as a user sees it.

    python benchmarks/decode_roofline.py --device cuda --preset qwen2.5-0.5b --batch 64
                                         --peak-gbps 4800
    python benchmarks/decode_roofline.py --quick        # CPU, tiny model: checks the script

Prints one JSON object (`frac_of_roofline` only when the peak bandwidth is known).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.run_record import RunRecord, add_output_args  # noqa: E402
from rollout import Engine, EngineConfig, SamplingParams  # noqa: E402
from rollout.kv_pool import KVPool  # noqa: E402
from rollout.random_checkpoint import QWEN25_05B, TINY_QWEN2, write_random_checkpoint  # noqa: E402

PRESETS = {"tiny": TINY_QWEN2, "qwen2.5-0.5b": QWEN25_05B}


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--preset", default="qwen2.5-0.5b", choices=sorted(PRESETS))
    ap.add_argument("--batch", type=int, nargs="+", default=[64])
    ap.add_argument("--context", type=int, default=1024, help="prompt tokens per sequence")
    ap.add_argument("--steps", type=int, default=32, help="timed decode steps")
    ap.add_argument("--attention-backend", default="torch", choices=["torch", "triton"])
    ap.add_argument(
        "--decode-graphs",
        default="auto",
        choices=["auto", "on", "off"],
        help="static-shape decode steps (CUDA graphs on a GPU); auto: on with triton on CUDA",
    )
    ap.add_argument(
        "--peak-gbps", type=float, default=None, help="peak memory bandwidth (GB/s) of the device"
    )
    ap.add_argument("--quick", action="store_true", help="CPU, tiny model, small sizes")
    add_output_args(ap)
    args = ap.parse_args(argv)
    if args.quick:
        args.device, args.dtype, args.preset, args.batch, args.context, args.steps = (
            "cpu",
            "float32",
            "tiny",
            [4],
            32,
            4,
        )
    return args


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(model_dir: str, args, batch: int) -> dict:
    device = torch.device(args.device)
    warm_steps = 2
    max_new = warm_steps + args.steps + 2
    engine = Engine(
        EngineConfig(
            model_path=model_dir,
            device=args.device,
            dtype=args.dtype,
            kv_cache_tokens=batch * (args.context + max_new + 16),
            max_running_requests=batch,
            max_prefill_tokens=max(4096, args.context),
            max_model_len=args.context + max_new + 16,
            attention_backend=args.attention_backend,
            decode_graphs={"auto": None, "on": True, "off": False}[args.decode_graphs],
        )
    )
    g = torch.Generator().manual_seed(batch)
    vocab = engine.model_config.vocab_size
    for _ in range(batch):
        prompt = torch.randint(1, vocab, (args.context,), generator=g).tolist()
        engine.add_request(
            prompt, SamplingParams(temperature=1.0, max_new_tokens=max_new, ignore_eos=True)
        )
    scheduler = engine.scheduler
    # Steady state: nothing waiting, nothing prefilling, every sequence decodes one token per step.
    while scheduler.waiting or any(
        len(s.token_ids) - s.num_computed > 1 for s in scheduler.running
    ):
        engine.step()
    for _ in range(warm_steps):
        engine.step()
    assert len(scheduler.running) == batch, "every sequence must be decoding"
    context_before = sum(s.num_computed for s in scheduler.running)
    _sync(device)
    start = time.perf_counter()
    for _ in range(args.steps):
        engine.step()
    _sync(device)
    step_s = (time.perf_counter() - start) / args.steps
    mc = engine.model_config
    # Each step reads the K/V of every computed token plus the one it writes.
    mean_context = context_before / batch + (args.steps + 1) / 2
    kv_bytes = (
        batch
        * mean_context
        * KVPool.bytes_per_token(mc.num_layers, mc.num_kv_heads, mc.head_dim, engine.dtype)
    )
    weight_bytes = sum(
        p.numel() * p.element_size()
        for name, p in engine.model.named_parameters()
        if "embed_tokens" not in name or mc.tie_word_embeddings
    )
    graphs = engine.decode_graphs
    row = {
        "batch": batch,
        "decode_graphs": graphs is not None and graphs.replays > 0,
        "context": round(mean_context, 1),
        "step_ms": round(step_s * 1e3, 3),
        "weight_bytes": weight_bytes,
        "kv_bytes": int(kv_bytes),
        "achieved_gbps": round((weight_bytes + kv_bytes) / step_s / 1e9, 1),
    }
    if args.peak_gbps:
        roofline_s = (weight_bytes + kv_bytes) / (args.peak_gbps * 1e9)
        row.update(
            roofline_ms=round(roofline_s * 1e3, 4), frac_of_roofline=round(roofline_s / step_s, 3)
        )
    return row


def main(argv=None) -> dict:
    record = RunRecord.start("decode_roofline", argv)
    args = parse_args(argv)
    report = {
        "device": args.device,
        "dtype": args.dtype,
        "preset": args.preset,
        "attention_backend": args.attention_backend,
        "decode_graphs": args.decode_graphs,
        "peak_gbps": args.peak_gbps,
        "rows": [],
    }
    with tempfile.TemporaryDirectory() as model_dir:
        write_random_checkpoint(
            model_dir, PRESETS[args.preset], seed=0, dtype=getattr(torch, args.dtype)
        )
        for batch in args.batch:
            report["rows"].append(measure(model_dir, args, batch))
    record.finish(report, args)
    return report


if __name__ == "__main__":
    json.dump(main(), sys.stdout, indent=2)
    sys.stdout.write("\n")

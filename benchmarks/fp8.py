"""FP8 rollout weights (`rollout.quantization: fp8`) against the model dtype: weight-sync bytes
and time, and decode throughput.

* `sync`: the trainer's bf16 weights pushed in process into an engine (ColocatedSender -> shared
  memory -> BucketReceiver, checksums on), the sender quantizing at sync time for the FP8 engine;
  bytes per push in total and for the linear layers alone (FP8 + float32 scales vs bf16; the
  acceptance bound is 0.55x), best-of-`--syncs` time of a push.
* `decode`: greedy decode of `--batch` sequences, `--new-tokens` each, tokens/s, the FP8 engine
  against the bf16 one, timed alternately (`--rounds` each, the median kept); on a GPU the FP8
  engine dequantizes each layer's weight on the fly at every forward, on a CPU it keeps the
  dequantized weights between updates (`rollout.fp8_linear`). Both engines' outputs are
  compared too (the FP8 engine samples from rounded weights: its tokens may differ).

Prints one JSON object (`--save`: benchmarks/results/fp8.json).

    python benchmarks/fp8.py [--hidden 1024 --layers 4 --vocab 32000] [--device cpu]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.run_record import RunRecord, add_output_args  # noqa: E402
from quantization import FP8_DTYPE, is_quantized_weight, scale_name  # noqa: E402
from rollout import Engine, EngineConfig, SamplingParams  # noqa: E402
from rollout.random_checkpoint import TINY_QWEN2, write_random_checkpoint  # noqa: E402
from rollout.weights import iter_safetensors  # noqa: E402
from weight_sync import BucketReceiver, ColocatedSender, Done  # noqa: E402

ENGINES = (("bf16", None), ("fp8", "fp8"))
ACCEPT_LINEAR_BYTES = 0.55  # FP8 linear-layer bytes per push / bf16's


def _config(args) -> dict:
    return {
        **TINY_QWEN2,
        "hidden_size": args.hidden,
        "intermediate_size": args.hidden * 11 // 4,
        "num_hidden_layers": args.layers,
        "num_attention_heads": args.hidden // 64,
        "num_key_value_heads": max(1, args.hidden // 256),
        "vocab_size": args.vocab,
        "max_position_embeddings": 1024,
        "torch_dtype": "bfloat16",
    }


def _engine(model_dir: str, device: str, quantization: str | None, kv_tokens: int) -> Engine:
    return Engine(
        EngineConfig(
            model_path=model_dir,
            device=device,
            dtype="bfloat16",
            kv_cache_tokens=kv_tokens,
            max_model_len=512,
            quantization=quantization,
        )
    )


def _sync(device: str) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def run_sync(model_dir, weights, device, quantization, bucket_bytes, syncs) -> dict:
    engine = _engine(model_dir, device, quantization, 64)
    receiver = BucketReceiver(engine)
    sent: dict[str, int] = {}

    def deliver(handle, manifest):
        for e in manifest.entries:
            sent[e.name] = e.numel * torch.empty((), dtype=manifest.dtype).element_size()
        return Done(receiver.load(handle, manifest))

    sender = ColocatedSender(
        deliver, bucket_bytes=bucket_bytes, device=device, quantization=quantization
    )
    times = []
    for _ in range(syncs):
        _sync(device)
        start = time.perf_counter()
        report = sender.send(weights.items())
        receiver.commit()
        _sync(device)
        times.append(time.perf_counter() - start)
    sender.close()
    linear = [n for n in weights if is_quantized_weight(n)]
    linear_bytes = sum(sent[n] + sent.get(scale_name(n), 0) for n in linear)
    del engine
    return {
        "bytes": report.nbytes,
        "linear_bytes": linear_bytes,
        "buckets": report.num_buckets,
        "best_s": min(times[1:] or times),  # the first push maps the buffers
        "times_s": times,
        "last_export_s": report.export_s,  # includes the sender's quantization
        "last_pack_s": report.pack_s,
        "last_load_s": report.load_s,
    }


def run_decode(model_dir, device, batch, new_tokens, rounds) -> dict:
    """Both engines built first, then timed alternately (bf16, fp8, bf16, ...) `rounds` times
    each, so a change of load on a shared box falls on both; the median round is reported."""
    engines = {name: _engine(model_dir, device, q, batch * 160) for name, q in ENGINES}
    vocab = engines["bf16"].model_config.vocab_size
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(1, vocab, (32,), generator=g).tolist() for _ in range(batch)]
    params = SamplingParams(temperature=0.0, max_new_tokens=new_tokens, ignore_eos=True)
    for engine in engines.values():
        engine.generate(prompts[:1], params)  # warm-up: first-call allocations
    times = {name: [] for name in engines}
    outs = {}
    for _ in range(rounds):
        for name, engine in engines.items():
            _sync(device)
            start = time.perf_counter()
            outs[name] = engine.generate(prompts, params)
            _sync(device)
            times[name].append(time.perf_counter() - start)
    result = {}
    for name, engine in engines.items():
        elapsed = statistics.median(times[name])
        weight_bytes = sum(p.numel() * p.element_size() for p in engine.model.parameters())
        linear_bytes = sum(
            p.numel() * p.element_size()
            for n, p in engine.model.named_parameters()
            if p.dtype == FP8_DTYPE or n.endswith("_scale_inv") or is_quantized_weight(n)
        )
        result[name] = {
            "tokens_per_s": batch * new_tokens / elapsed,
            "elapsed_s": elapsed,
            "elapsed_s_per_round": times[name],
            "weight_bytes": weight_bytes,
            "linear_weight_bytes": linear_bytes,
            "tokens": [s.token_ids for per in outs[name] for s in per],
        }
    return result


def main(argv=None) -> dict:
    record = RunRecord.start("fp8", argv)
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--bucket-mb", type=int, default=64)
    parser.add_argument("--syncs", type=int, default=3, help="pushes per setting (best kept)")
    parser.add_argument("--batch", type=int, default=8, help="decoding sequences")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument(
        "--rounds", type=int, default=3, help="timed decodes per engine, alternating (median kept)"
    )
    parser.add_argument("--skip-decode", action="store_true")
    add_output_args(parser)
    args = parser.parse_args(argv)
    loadavg = [os.getloadavg()]  # the box may be shared: a time means little without its load
    with tempfile.TemporaryDirectory() as model_dir:
        write_random_checkpoint(model_dir, _config(args), dtype=torch.bfloat16)
        weights = {n: t.to(args.device) + 0.001 for n, t in iter_safetensors(model_dir)}
        sync = {
            name: run_sync(
                model_dir, weights, args.device, q, args.bucket_mb << 20, max(1, args.syncs)
            )
            for name, q in (("bf16", None), ("fp8", "fp8"))
        }
        decode = None
        if not args.skip_decode:
            decode = run_decode(
                model_dir, args.device, args.batch, args.new_tokens, max(1, args.rounds)
            )
    linear_ratio = sync["fp8"]["linear_bytes"] / sync["bf16"]["linear_bytes"]
    result = {
        "device": args.device,
        "model": {"hidden": args.hidden, "layers": args.layers, "vocab": args.vocab},
        "torch_num_threads": torch.get_num_threads(),
        "sync": sync,
        "sync_linear_bytes_fp8_over_bf16": linear_ratio,
        "sync_bytes_fp8_over_bf16": sync["fp8"]["bytes"] / sync["bf16"]["bytes"],
        "sync_time_fp8_over_bf16": sync["fp8"]["best_s"] / sync["bf16"]["best_s"],
        "accept_linear_bytes": ACCEPT_LINEAR_BYTES,
        "accepted": linear_ratio <= ACCEPT_LINEAR_BYTES,
        "loadavg_1_5_15_start_end": loadavg + [os.getloadavg()],
    }
    if decode is not None:
        bf16, fp8 = decode["bf16"], decode["fp8"]
        same = sum(a == b for a, b in zip(bf16.pop("tokens"), fp8.pop("tokens")))
        result["decode"] = {
            **decode,
            "batch": args.batch,
            "new_tokens": args.new_tokens,
            "rounds": args.rounds,
            "fp8_over_bf16_tokens_per_s": fp8["tokens_per_s"] / bf16["tokens_per_s"],
            "greedy_sequences_identical": same,
        }
    record.finish(result, args)
    return result


if __name__ == "__main__":
    print(json.dumps(main(), indent=2))

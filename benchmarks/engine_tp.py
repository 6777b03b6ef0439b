"""Engine tensor parallelism on a device: one replica over 2 ranks against TP=1, same weights.

    python benchmarks/engine_tp.py                 # 2 CUDA devices: NCCL, one rank per GPU
    python benchmarks/engine_tp.py --device cpu    # gloo, 2 CPU processes (the suite's dry run)

The model is `TINY_QWEN2` (4 heads over 2 KV heads, vocabulary 4096) with weights of std 0.1 in
float32 (TF32 off), so greedy choices are decisive and the check is strict: every greedy sample
of TP=2 (16 prompts, 32 tokens) equals TP=1's, log-probs within 1e-4. `--quick`: a smaller
model, 4 prompts, 4 tokens. Also timed: greedy decode tokens / s of both (at
this size the figure measures TP's per-step overhead, the command broadcast and collectives, not
the speedup a large model gets). Prints one JSON object; `main(argv)` returns it.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks.run_record import RunRecord, add_output_args  # noqa: E402

NUM_PROMPTS, MAX_NEW_TOKENS = 16, 32
QUICK = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, vocab_size=512)


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument(
        "--quick", action="store_true", help="a smaller model, 4 prompts, 4 tokens (dry runs)"
    )
    add_output_args(ap)
    return ap.parse_args(argv)


def _prompts(count: int, vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [
        torch.randint(1, vocab, (int(n),), generator=g).tolist()
        for n in torch.randint(8, 64, (count,), generator=g)
    ]


def _run(config, quick: bool) -> dict:
    """Greedy samples of every prompt, and decode tokens / s (after one warm-up call)."""
    from rollout import SamplingParams
    from rollout.tp_follower import run_rank

    engine = run_rank(config)
    if engine is None:  # a follower: it served rank 0 until rank 0 closed the engine
        return {}
    count, max_new_tokens = (4, 4) if quick else (NUM_PROMPTS, MAX_NEW_TOKENS)
    params = SamplingParams(temperature=0.0, max_new_tokens=max_new_tokens, ignore_eos=True)
    prompts = _prompts(count, engine.model_config.vocab_size)
    engine.generate(prompts[:2], params)
    sync = torch.cuda.synchronize if config.device.startswith("cuda") else (lambda: None)
    sync()
    t0 = time.perf_counter()
    outs = engine.generate(prompts, params)
    sync()
    seconds = time.perf_counter() - t0
    engine.close()
    return {
        "tokens": [s.token_ids for per in outs for s in per],
        "logprobs": [s.logprobs for per in outs for s in per],
        "tokens_per_s": count * max_new_tokens / seconds,
    }


def _config(model_dir: str, device: str, tp: int):
    from rollout import EngineConfig

    return EngineConfig(
        model_path=model_dir,
        device=device,
        dtype="float32",
        kv_cache_tokens=NUM_PROMPTS * 128,
        max_model_len=256,
        attention_backend="torch",
        tp=tp,
    )


def _rank(rank: int, port: int, model_dir: str, device: str, quick: bool, out: str) -> None:
    if device == "cuda":
        torch.cuda.set_device(rank)
        torch.backends.cuda.matmul.allow_tf32 = False
    dist.init_process_group(
        "nccl" if device == "cuda" else "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=2,
    )
    try:
        result = _run(_config(model_dir, f"cuda:{rank}" if device == "cuda" else "cpu", 2), quick)
        if rank == 0:
            torch.save(result, out)
    finally:
        dist.destroy_process_group()


def main(argv=None) -> dict:
    record = RunRecord.start("engine_tp", argv)
    args = parse_args(argv)
    if args.device == "cuda" and torch.cuda.device_count() < 2:
        return {"skipped": f"engine TP=2 needs 2 CUDA devices; {torch.cuda.device_count()} here"}
    from rollout.random_checkpoint import TINY_QWEN2, write_random_checkpoint

    if args.device == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = str(Path(tmp) / "model")
        shape = {**TINY_QWEN2, **(QUICK if args.quick else {})}
        write_random_checkpoint(model_dir, shape, seed=0, std=0.1)
        single = _run(_config(model_dir, args.device, 1), args.quick)
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        out = str(Path(tmp) / "tp2.pt")
        mp.spawn(
            _rank,
            args=(port, model_dir, args.device, args.quick, out),
            nprocs=2,
            join=True,
        )
        tp2 = torch.load(out)
    same = sum(a == b for a, b in zip(single["tokens"], tp2["tokens"]))
    diff = max(
        abs(x - y) for a, b in zip(single["logprobs"], tp2["logprobs"]) for x, y in zip(a, b)
    )
    result = {
        "ok": same == len(single["tokens"]) and diff < 1e-4,
        "device": args.device,
        "backend": "nccl" if args.device == "cuda" else "gloo",
        "samples": len(single["tokens"]),
        "identical_samples": same,
        "max_logprob_diff": diff,
        "tp1_tokens_per_s": round(single["tokens_per_s"], 1),
        "tp2_tokens_per_s": round(tp2["tokens_per_s"], 1),
    }
    record.finish(result, args)
    return result


if __name__ == "__main__":
    print(json.dumps(main()), flush=True)
    sys.stderr.flush()
    # The result is out. Skip interpreter teardown: a collective backend's threads still alive
    # at exit can abort the process ("terminate called without an active exception"), which
    # would turn a finished, correct run into a failed one.
    os._exit(0)

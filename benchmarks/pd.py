"""Prefill-decode disaggregation vs every replica doing both, on agent sessions with long,
growing contexts and mixed arrivals, the same total replicas. Prints one JSON object.

Engines: `--replicas` `AsyncEngine`s on a random-init tiny Qwen2, in this process (their step
loops are threads; torch releases the GIL inside its kernels). Plain: session s stays on replica
s mod N and every turn is streamed there (`AsyncEngine.stream`). PD: the first `--prefill`
replicas only prefill (`submit_prefill`, the replica the cache-aware router picks), the handoff
goes through the actors' same-node transport (`miles_like.run.handoff_transport`: a shared-
memory copy in, a copy out) and session s decodes on decode replica s mod (N - k)
(`stream(..., handoff=)`).

The workload (`benchmarks/agent_sessions.py`'s, longer): each turn's prompt is the previous
prompt + its completion + a new user chunk of `--turn-tokens` random ids; half the sessions
start at once (a burst), the others arrive one every `--arrival-gap-s` on average
(exponential), and each waits up to `--think-s` between turns. Measured per turn: time to first
token (submission to the first token known: the first streamed delta, or the handoff in PD),
inter-token latency (gaps between a turn's later deltas), and generated tokens per second over
the whole run; PD adds the handoffs' bytes and transfer seconds.

    python benchmarks/pd.py [--sessions 16 --turns 4 --replicas 3 --prefill 1] [--quick] [--save]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

# Run as a script: the repository's packages import only once it is on sys.path (above).
import torch  # noqa: E402

from benchmarks.run_record import RunRecord, add_output_args  # noqa: E402
from miles_like.run.handoff_transport import HandoffReceiver, HandoffSender  # noqa: E402
from rollout import Engine, EngineConfig, SamplingParams  # noqa: E402
from rollout.async_engine import AsyncEngine, TokenDelta  # noqa: E402
from rollout.random_checkpoint import TINY_QWEN2, write_random_checkpoint  # noqa: E402
from rollout.serving.router import Router  # noqa: E402


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


class Replicas:
    """N engines; with `prefill` > 0 the first ones only prefill."""

    def __init__(self, model_dir: str, args, prefill: int):
        cfg = EngineConfig(
            model_path=model_dir,
            dtype="float32",
            kv_cache_tokens=args.kv_cache_tokens,
            page_size=args.page_size,
            max_model_len=args.max_model_len,
            seed=0,
        )
        self.engines = [AsyncEngine(Engine(cfg)) for _ in range(args.replicas)]
        for e in self.engines:  # first-call costs (allocations, lazy inits) before measuring
            e.submit([1, 2, 3], SamplingParams(max_new_tokens=2)).result()
            e.engine.flush_prefix_cache()
        self.prefill = prefill
        self.router = Router(prefill) if prefill else None
        self.sender, self.receiver = HandoffSender("cpu"), HandoffReceiver("cpu")
        self.transfer_bytes: list[int] = []
        self.transfer_s: list[float] = []

    def close(self) -> None:
        for e in self.engines:
            e.close()
        self.sender.release_all()
        self.receiver.close()

    async def turn(self, session: int, prompt: list[int], params: SamplingParams):
        """One turn: (its completion, time to first token, inter-token gaps)."""
        start = time.perf_counter()
        decoders = len(self.engines) - self.prefill
        engine = self.engines[self.prefill + session % decoders]
        handoff, ttft = None, None
        if self.prefill:
            p = self.router.choose(prompt)
            self.router.started(p)
            try:
                (future,) = self.engines[p].submit_prefill([(prompt, params)])
                made = await asyncio.wrap_future(future)
            finally:
                self.router.finished(p)
            ttft = time.perf_counter() - start  # the first token is known
            moved = time.perf_counter()
            key, shared = self.sender.share([made])
            (handoff,) = self.receiver.open(shared)
            self.sender.release(key)
            self.transfer_s.append(time.perf_counter() - moved)
            self.transfer_bytes.append(handoff.nbytes)
        tokens, gaps, last = [], [], None
        async for item in engine.stream(prompt, params, handoff=handoff):
            if not isinstance(item, TokenDelta) or not item.token_ids:
                continue
            now = time.perf_counter()
            if ttft is None:
                ttft = now - start
            elif last is not None:
                gaps.append((now - last) / len(item.token_ids))
            last = now
            tokens += item.token_ids
        return tokens, ttft, gaps


async def run_sessions(replicas: Replicas, args, vocab: int, seed: int) -> dict:
    rng = random.Random(seed)
    ttfts: list[float] = []
    gaps: list[float] = []
    generated = 0
    burst = args.sessions // 2
    arrivals, t = [], 0.0
    for s in range(args.sessions):
        if s >= burst:
            t += rng.expovariate(1.0 / args.arrival_gap_s)
        arrivals.append(0.0 if s < burst else t)

    async def session(s: int) -> None:
        nonlocal generated
        local = random.Random(seed * 1000 + s)
        await asyncio.sleep(arrivals[s])
        prompt = [local.randrange(vocab) for _ in range(args.first_tokens)]
        for k in range(args.turns):
            params = SamplingParams(
                n=1,
                temperature=1.0,
                max_new_tokens=args.completion_tokens,
                ignore_eos=True,
                seed=seed * 1000 + s * 10 + k,
            )
            completion, ttft, turn_gaps = await replicas.turn(s, prompt, params)
            ttfts.append(ttft)
            gaps.extend(turn_gaps)
            generated += len(completion)
            prompt = prompt + completion + [local.randrange(vocab) for _ in range(args.turn_tokens)]
            await asyncio.sleep(local.uniform(0, args.think_s))

    start = time.perf_counter()
    await asyncio.gather(*(session(s) for s in range(args.sessions)))
    elapsed = time.perf_counter() - start
    return {
        "ttft_p50_s": percentile(ttfts, 0.50),
        "ttft_p99_s": percentile(ttfts, 0.99),
        "itl_p50_s": percentile(gaps, 0.50),
        "itl_p99_s": percentile(gaps, 0.99),
        "generated_tokens_per_s": generated / elapsed,
        "turns": len(ttfts),
        "wall_s": elapsed,
    }


def main() -> None:
    record = RunRecord.start("pd")
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--sessions", type=int, default=16)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--first-tokens", type=int, default=512)
    ap.add_argument("--turn-tokens", type=int, default=256, help="new user chunk per turn")
    ap.add_argument("--completion-tokens", type=int, default=32)
    ap.add_argument("--arrival-gap-s", type=float, default=0.5)
    ap.add_argument("--think-s", type=float, default=0.5)
    ap.add_argument("--replicas", type=int, default=3)
    ap.add_argument("--prefill", type=int, default=1, help="prefill replicas in the PD run")
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--kv-cache-tokens", type=int, default=65536)
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true", help="a small run (smoke test)")
    add_output_args(ap)
    args = ap.parse_args()
    if args.quick:
        args.sessions, args.turns, args.first_tokens, args.turn_tokens = 4, 2, 64, 16
        args.completion_tokens, args.arrival_gap_s, args.think_s = 8, 0.05, 0.05
        args.kv_cache_tokens = 8192
    if not 0 < args.prefill < args.replicas:
        ap.error(f"--prefill={args.prefill} must leave a decode replica of --replicas")
    torch.set_num_threads(1)
    result: dict = {
        "load_average_start": os.getloadavg(),
        "workload": {
            k: getattr(args, k)
            for k in (
                "sessions",
                "turns",
                "first_tokens",
                "turn_tokens",
                "completion_tokens",
                "arrival_gap_s",
                "think_s",
                "replicas",
                "prefill",
                "quick",
            )
        },
    }
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = str(write_random_checkpoint(Path(tmp) / "tiny", {**TINY_QWEN2}))
        vocab = TINY_QWEN2["vocab_size"]
        for name, prefill in (("plain", 0), ("pd", args.prefill)):
            replicas = Replicas(model_dir, args, prefill)
            try:
                result[name] = asyncio.run(run_sessions(replicas, args, vocab, args.seed))
                if prefill:
                    n = max(len(replicas.transfer_s), 1)
                    result[name]["transfer_bytes_per_request"] = sum(replicas.transfer_bytes) / n
                    result[name]["transfer_s_per_request"] = sum(replicas.transfer_s) / n
            finally:
                replicas.close()
    plain, pd = result["plain"], result["pd"]
    result["pd_over_plain"] = {
        k: pd[k] / plain[k]
        for k in ("ttft_p50_s", "ttft_p99_s", "itl_p50_s", "itl_p99_s", "generated_tokens_per_s")
        if pd[k] and plain[k]
    }
    result["load_average_end"] = os.getloadavg()
    record.finish(result, args)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()

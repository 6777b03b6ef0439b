"""`benchmarks/gpu_suite.sh --dry-run` runs the real sections on CPU (Triton interpreted, tiny
sizes), so the one script a GPU session gets to run is known to work before it costs device
time: the plan, the preflight, one JSON line per section (those without a CPU form skipped:
needs CUDA), the summary, and the same lines in $OUT. Every check a section makes on CPU
compares against an independent reference (the torch attention, HF transformers, a fresh
engine, the trainer's own export); the GPU-only checks (free device memory after a release,
graphs replayed rather than re-captured) are not made here."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
CPU_SECTIONS = (
    "kernels",
    "decode_graphs",
    "colocation",
    "engine_vs_hf",
    "megatron",
    "speculation",
    "throughput",
    "fp8",
    "prefill_decode",
)


@pytest.mark.slow  # every section with a CPU form, each in its own processes
def test_dry_run_prints_the_plan_and_one_line_per_section(tmp_path):
    proc = subprocess.run(
        ["bash", str(REPO / "benchmarks" / "gpu_suite.sh"), "--dry-run"],
        cwd=REPO,
        env={**os.environ, "OUT": str(tmp_path)},
        capture_output=True,
        text=True,
        timeout=960,
    )
    lines = [json.loads(line) for line in proc.stdout.splitlines()]
    plan, preflight, *sections, summary = lines
    assert [s["name"] for s in plan["plan"]["sections"]] == [*CPU_SECTIONS, "compiled_decode"]
    assert plan["plan"]["planned_s"] > 0 and plan["plan"]["not_covered"]
    assert preflight["status"] == "ok" and preflight["env"]["triton_interpret"] is True
    by_name = {s["section"]: s for s in sections}
    assert by_name["compiled_decode"]["skipped"] == "needs CUDA"
    for name in CPU_SECTIONS:
        line = by_name[name]
        assert line["status"] == "ok", (name, line.get("error"), line.get("log_tail"))
        assert line["checks"] and all(c["ok"] for c in line["checks"]), name
    assert summary["summary"]["ok"] is True and proc.returncode == 0, proc.stderr[-3000:]
    assert (tmp_path / "gpu_suite.jsonl").read_text().splitlines() == proc.stdout.splitlines()

    kernels = {c["name"] for c in by_name["kernels"]["checks"]}
    for tag in ("qwen0.5b_float32", "qwen7b_float16", "qwen7b_bfloat16", "mha128_bfloat16"):
        assert {f"kv_store_{tag}", f"paged_decode_graph_width_{tag}", f"cascade_q4_{tag}"} <= (
            kernels
        )
    graphs = {c["name"]: c for c in by_name["decode_graphs"]["checks"]}
    for stage in ("as_loaded", "after_update", "after_release_resume"):
        check = graphs[f"graphs_equal_eager_{stage}"]
        assert check["identical_samples"] == check["samples"] == 24 and check["static_steps"] > 0
    colocation = {c["name"] for c in by_name["colocation"]["checks"]}
    assert {"synced_weights_bitwise_equal", "generations_equal_fresh_engine"} <= colocation
    megatron = {c["name"]: c for c in by_name["megatron"]["checks"]}
    assert (
        megatron["mismatch_after_sync"]["mismatch_kl"] <= megatron["mismatch_after_sync"]["bound"]
    )
    speculation = {c["name"]: c for c in by_name["speculation"]["checks"]}
    assert all(speculation[f"greedy_equal_{m}"]["spec_accepted_tokens"] > 0 for m in ("group",))
    assert by_name["throughput"]["result"]["engine_tokens_per_s"] > 0
    fp8 = {c["name"] for c in by_name["fp8"]["checks"]}
    assert {
        "fp8_engine_equals_dequantized_weights",
        "fp8_weights_are_the_checkpoints_quantized",
    } <= (fp8)
    pd = {c["name"]: c for c in by_name["prefill_decode"]["checks"]}
    assert all(c["kv_bitwise"] for c in pd.values())
    assert pd["pd_equals_one_engine_with_prefix_hits"]["cached_tokens"] > 0
    assert by_name["prefill_decode"]["result"]["transfer"]["handoff_bytes"] > 0

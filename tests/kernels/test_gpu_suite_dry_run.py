"""`benchmarks/gpu_suite.sh --dry-run` runs every section on CPU (Triton interpreter, tiny sizes),
so the one script a GPU session gets to run is known to work before it costs device time. The
kernel checks compare against the torch reference; the other sections only have to produce their
figures (their speed on CPU means nothing)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow  # every section end to end, each in its own processes
def test_gpu_suite_dry_run_runs_every_section(tmp_path):
    out, md = tmp_path / "suite.json", tmp_path / "RESULTS.md"
    proc = subprocess.run(
        [
            "bash",
            str(REPO / "benchmarks" / "gpu_suite.sh"),
            "--dry-run",
            "--json-out",
            str(out),
            "--results-md",
            str(md),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=960,
    )
    report = json.loads(out.read_text())
    assert proc.returncode == 0 and report["ok"], (report.get("errors"), proc.stderr[-3000:])
    assert report["errors"] == {}
    assert (
        all(check["ok"] for check in report["kernels"]["checks"])
        and len(report["kernels"]["checks"]) >= 10
    )
    assert report["decode_graphs"]["ok"] and report["decode_graphs"]["identical_samples"] == 24
    comp = report["compiled_decode"]
    assert comp["ok"] and comp["identical_samples"] == comp["samples"] == 24
    assert report["engine_vs_hf"]["engine_all_samples_full_length"] is True
    assert report["speculation"]["models"]["weight_std=1.0"]["group"]["spec_verify_steps"] > 0
    assert report["decode_roofline"]["torch"]["rows"][0]["step_ms"] > 0
    assert report["weight_sync"]["colocated"]["bitwise_equal"] is True
    # engine TP=2 (gloo ranks on CPU in the dry run): greedy samples identical to TP=1
    tp = report["engine_tp"]
    assert tp["ok"] and tp["identical_samples"] == tp["samples"] == 4
    assert tp["max_logprob_diff"] < 1e-4 and tp["backend"] == "gloo"
    # the bf16 RL steps ran through the CLI and logged their mismatch and sync
    steps = report["rl_step_bf16"]["steps"]
    assert len(steps) == 2 and all(s["perf/weight_sync_bytes"] > 0 for s in steps)
    assert all(0 <= s["train/mismatch_kl"] < 1e-2 for s in steps)
    summary = md.read_text()
    for heading in (
        "Kernel checks",
        "Decode graphs",
        "Compiled decode",
        "Engine vs HF",
        "| speculation",
        "| decode step",
        "Weight sync",
        "Engine TP=2",
        "| bf16 RL step",
    ):
        assert heading in summary, heading

"""Smoke test: benchmarks/train_throughput.py --quick runs both backends and prints its JSON."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_quick_benchmark_prints_both_backends():
    proc = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "train_throughput.py"), "--quick"],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=REPO,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = json.loads(proc.stdout)  # stdout is exactly one JSON object
    for backend in ("megatron", "deepspeed"):
        assert out[backend]["train_tokens_per_s"] > 0
        assert out[backend]["tokens_per_step"] == 4 * (8 + 24)
    assert out["megatron_over_deepspeed"] == pytest.approx(
        out["megatron"]["train_tokens_per_s"] / out["deepspeed"]["train_tokens_per_s"]
    )

"""Smoke test: benchmarks/train_throughput.py --quick runs both backends and prints its JSON."""

from __future__ import annotations

import pytest
from benchmark_runs import run_benchmark


@pytest.mark.slow
def test_quick_benchmark_prints_both_backends():
    out = run_benchmark("train_throughput.py", "--quick")
    for backend in ("megatron", "deepspeed"):
        assert out[backend]["train_tokens_per_s"] > 0
        assert out[backend]["tokens_per_step"] == 4 * (8 + 24)
    assert out["megatron_over_deepspeed"] == pytest.approx(
        out["megatron"]["train_tokens_per_s"] / out["deepspeed"]["train_tokens_per_s"]
    )

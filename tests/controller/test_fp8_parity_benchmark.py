"""Smoke test: benchmarks/fp8_parity.py --quick runs the default recipe in bf16 with TIS, rollout
in bf16 and in FP8, for two seeds each, and prints its JSON; its figures are checked against
the per-step rewards and mismatch KLs it printed, and the paired analysis against scipy's
paired t-test (the statistics themselves are async_learning.py's, tested there); `--resume`
then reuses the four finished runs."""

from __future__ import annotations

import statistics

import pytest
from benchmark_runs import run_benchmark
from scipy import stats


@pytest.mark.slow
def test_quick_benchmark_compares_fp8_and_bf16_rollouts(tmp_path):
    out = run_benchmark("fp8_parity.py", "--quick", "--output-dir", str(tmp_path), timeout=1200)
    assert out["reused_runs"] == []
    k = out["k"]
    assert out["seeds"] == [0, 1] and out["steps"] == 2
    assert "model.dtype=bfloat16" in out["overrides"]["common"]
    assert "algorithm.is_correction=tis" in out["overrides"]["common"]
    assert out["overrides"]["fp8"] == ["rollout.quantization=fp8"]
    for arm in ("bf16", "fp8"):
        runs = out["runs"][arm]
        assert [r["seed"] for r in runs] == [0, 1]
        for r in runs:
            reward, kl = r["reward_per_step"], r["mismatch_kl_per_step"]
            assert len(reward) == len(kl) == r["steps"] == out["steps"]
            assert all(0.0 <= x <= 1.0 for x in reward)
            assert r["gain"] == pytest.approx(
                statistics.mean(reward[-k:]) - statistics.mean(reward[:k]), abs=1e-4
            )
            # bf16 engine and trainer round differently; FP8 rounds the weights too
            assert all(x >= 0.0 for x in kl) and r["mismatch_kl_mean"] == pytest.approx(
                statistics.mean(kl)
            )
        summary = out["arms"][arm]
        assert summary["gains"] == [r["gain"] for r in runs]
        assert summary["gain_std"] == pytest.approx(statistics.stdev(summary["gains"]))
        assert summary["mismatch_kl_mean"] == pytest.approx(
            statistics.mean(r["mismatch_kl_mean"] for r in runs)
        )
    gains = {arm: out["arms"][arm]["gains"] for arm in ("bf16", "fp8")}
    pair = out["comparisons"]["fp8_minus_bf16"]["paired"]
    assert pair["differences"] == pytest.approx(
        [f - b for f, b in zip(gains["fp8"], gains["bf16"])]
    )
    assert out["margin"] == pytest.approx(out["margin_frac"] * abs(statistics.mean(gains["bf16"])))
    assert pair["margin"] == out["margin"]
    if statistics.variance(pair["differences"]) > 0:
        rel = stats.ttest_rel(gains["fp8"], gains["bf16"])
        assert [pair["t"], pair["p_value"]] == pytest.approx([rel.statistic, rel.pvalue])
    # --resume reuses every finished run and reproduces the analysis
    again = run_benchmark("fp8_parity.py", "--quick", "--output-dir", str(tmp_path), "--resume")
    assert sorted(again["reused_runs"]) == ["bf16_0", "bf16_1", "fp8_0", "fp8_1"]
    assert again["runs"] == out["runs"] and again["comparisons"] == out["comparisons"]

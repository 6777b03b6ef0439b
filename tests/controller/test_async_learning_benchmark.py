"""Smoke test: benchmarks/async_learning.py --quick runs the chain recipe sync and fully async
for two seeds each and prints its JSON; its figures are checked against the per-step rewards it
printed and a hand-written Welch t-test and equivalence test (not scipy's); the paired analysis
(the primary test) is checked against scipy's paired and one-sample t-tests."""

from __future__ import annotations

import importlib.util
import math
import statistics

import pytest
from benchmark_runs import REPO, run_benchmark
from scipy import stats


def benchmark_module():
    spec = importlib.util.spec_from_file_location(
        "async_learning", REPO / "benchmarks" / "async_learning.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def welch_by_hand(a: list[float], b: list[float]) -> tuple[float, float, tuple[float, float]]:
    """Welch's t-test from its textbook formulas: (t, two-sided p, 95% CI of mean(a) - mean(b))."""
    va, vb = statistics.variance(a) / len(a), statistics.variance(b) / len(b)
    se = math.sqrt(va + vb)
    df = (va + vb) ** 2 / (va**2 / (len(a) - 1) + vb**2 / (len(b) - 1))
    diff = statistics.mean(a) - statistics.mean(b)
    half = stats.t.ppf(0.975, df) * se
    return diff / se, 2 * stats.t.sf(abs(diff / se), df), (diff - half, diff + half)


def tost_by_hand(a: list[float], b: list[float], margin: float) -> tuple[float, float, float]:
    """TOST from the textbook: the two one-sided Welch p-values (H0: diff <= -margin, H0: diff
    >= +margin) and their maximum."""
    va, vb = statistics.variance(a) / len(a), statistics.variance(b) / len(b)
    se = math.sqrt(va + vb)
    df = (va + vb) ** 2 / (va**2 / (len(a) - 1) + vb**2 / (len(b) - 1))
    diff = statistics.mean(a) - statistics.mean(b)
    p_lower = stats.t.sf((diff + margin) / se, df)
    p_upper = stats.t.cdf((diff - margin) / se, df)
    return p_lower, p_upper, max(p_lower, p_upper)


@pytest.mark.slow
def test_quick_benchmark_compares_sync_and_async_learning():
    out = run_benchmark("async_learning.py", "--quick", timeout=1200)
    steps, k = out["steps"], out["k"]
    assert out["seeds"] == 2
    for mode in ("sync", "async"):
        runs = out["runs"][mode]
        assert [r["seed"] for r in runs] == [0, 1]
        for r in runs:
            reward = r["reward_per_step"]
            assert len(reward) == r["steps"] == steps
            assert all(0.0 <= x <= 1.0 for x in reward)
            assert r["gain"] == pytest.approx(
                statistics.mean(reward[-k:]) - statistics.mean(reward[:k])
            )
            assert 0 < r["step_s_sum"] < r["run_wall_s"]
        assert out["mean"][mode]["gain_std"] == pytest.approx(
            statistics.stdev(r["gain"] for r in runs)
        )
    # the same trained samples in both modes, seed by seed
    for s, a in zip(out["runs"]["sync"], out["runs"]["async"]):
        assert s["trained_samples"] == a["trained_samples"] > 0
    # sync is on-policy; async trains groups at most max_staleness = 1 version old
    assert all(r["staleness_mean"] == 0.0 for r in out["runs"]["sync"])
    assert all(0.0 <= r["staleness_mean"] <= 1.0 for r in out["runs"]["async"])
    gains = {m: [r["gain"] for r in out["runs"][m]] for m in ("sync", "async")}
    welch = out["gain_async_minus_sync"]
    assert welch["difference"] == pytest.approx(
        statistics.mean(gains["async"]) - statistics.mean(gains["sync"])
    )
    if statistics.variance(gains["async"]) + statistics.variance(gains["sync"]) == 0:
        assert welch["p_value"] is None  # no spread in either mode: the test is undefined
    else:
        t, p, ci = welch_by_hand(gains["async"], gains["sync"])
        assert [welch["t"], welch["p_value"], *welch["ci95"]] == pytest.approx([t, p, *ci])
    pair = out["paired_async_minus_sync"]
    assert pair["differences"] == pytest.approx(
        [a - s for a, s in zip(gains["async"], gains["sync"])]
    )
    assert pair["margin"] == out["equivalence_tost"]["margin"]
    tost = out["equivalence_tost"]
    assert tost["margin"] == pytest.approx(out["margin_frac"] * abs(out["mean"]["sync"]["gain"]))
    assert out["overrides"]["async"][-1] == "rollout.partial=retract"
    ratio = out["wall_ratio_async_over_sync"]["step_s_sum"]
    assert ratio == pytest.approx(
        out["mean"]["async"]["step_s_sum"] / out["mean"]["sync"]["step_s_sum"]
    )


@pytest.mark.parametrize(
    "a, b",
    [
        ([0.10, 0.14, 0.12], [0.03, 0.08, 0.01]),  # a clear difference
        ([0.05, -0.02, 0.09, 0.01], [0.04, 0.00, 0.07]),  # within noise, unequal sizes
    ],
)
def test_welch_summary_matches_the_textbook_formulas(a, b):
    welch = benchmark_module().welch(a, b)
    t, p, ci = welch_by_hand(a, b)
    assert welch["difference"] == pytest.approx(statistics.mean(a) - statistics.mean(b))
    assert [welch["t"], welch["p_value"], *welch["ci95"]] == pytest.approx([t, p, *ci])
    assert welch["ci95"][0] < welch["difference"] < welch["ci95"][1]


@pytest.mark.parametrize(
    "a, b, margin, equivalent, non_inferior",
    [
        # close and tight: equivalent
        ([0.30, 0.32, 0.29, 0.31, 0.30], [0.31, 0.30, 0.32, 0.29, 0.31], 0.05, True, True),
        # a clearly ahead: not equivalent, but not worse
        ([0.30, 0.32, 0.29, 0.31, 0.30], [0.21, 0.20, 0.22, 0.19, 0.21], 0.05, False, True),
        # a clearly behind
        ([0.21, 0.20, 0.22, 0.19, 0.21], [0.30, 0.32, 0.29, 0.31, 0.30], 0.05, False, False),
        # too noisy to tell
        ([0.1, 0.5, 0.2, 0.6], [0.3, 0.2, 0.5, 0.4], 0.05, False, False),
    ],
)
def test_equivalence_matches_the_textbook_tost(a, b, margin, equivalent, non_inferior):
    tost = benchmark_module().equivalence(a, b, margin)
    p_lower, p_upper, p = tost_by_hand(a, b, margin)
    assert [tost["p_lower"], tost["p_upper"], tost["p_value"]] == pytest.approx(
        [p_lower, p_upper, p]
    )
    assert tost["equivalent_at_0_05"] is equivalent
    assert tost["non_inferior_at_0_05"] is non_inferior is bool(p_lower < 0.05)
    # equivalent at 0.05 exactly when the 90% interval lies inside the margin
    low, high = tost["ci90"]
    assert (-margin < low and high < margin) is equivalent


@pytest.mark.parametrize(
    "a, b, margin",
    [
        # the seeds differ a lot, their pairs little: the paired test sees what Welch cannot
        ([0.10, 0.31, 0.52, 0.20, 0.41], [0.11, 0.30, 0.50, 0.22, 0.40], 0.05),
        # a clearly ahead of its pair, seed by seed
        ([0.30, 0.32, 0.29, 0.31, 0.30, 0.35], [0.21, 0.20, 0.22, 0.19, 0.21, 0.22], 0.05),
        # a clearly behind
        ([0.21, 0.20, 0.22, 0.19], [0.30, 0.32, 0.29, 0.31], 0.05),
        # too noisy to tell
        ([0.1, 0.5, 0.2, 0.6], [0.3, 0.2, 0.5, 0.4], 0.05),
    ],
)
def test_paired_analysis_matches_scipy(a, b, margin):
    out = benchmark_module().paired(a, b, margin)
    d = [x - y for x, y in zip(a, b)]
    assert out["differences"] == pytest.approx(d)
    assert out["mean"] == pytest.approx(statistics.mean(d))
    assert out["se"] == pytest.approx(stats.sem(d))
    rel = stats.ttest_rel(a, b)
    assert [out["t"], out["p_value"]] == pytest.approx([rel.statistic, rel.pvalue])
    ci95 = rel.confidence_interval(0.95)
    assert out["ci95"] == pytest.approx([ci95.low, ci95.high])
    # the two one-sided tests, each from scipy's paired test on the shifted pairs
    p_lower = stats.ttest_rel([x + margin for x in a], b, alternative="greater").pvalue
    p_upper = stats.ttest_rel(a, [y + margin for y in b], alternative="less").pvalue
    assert [out["tost_p_lower"], out["tost_p_upper"]] == pytest.approx([p_lower, p_upper])
    assert out["tost_p_value"] == pytest.approx(max(p_lower, p_upper))
    assert out["non_inferior_at_0_05"] is bool(p_lower < 0.05)
    # equivalent at 0.05 exactly when the paired 90% interval lies inside the margin
    low, high = out["ci90"]
    assert [low, high] == pytest.approx(list(rel.confidence_interval(0.90)))
    assert out["equivalent_at_0_05"] is (-margin < low and high < margin)


def test_paired_analysis_is_stronger_than_welch_on_paired_seeds():
    # seeds that differ by far more than their sync / async pairs do
    a, b = [0.10, 0.31, 0.52, 0.20, 0.41], [0.11, 0.30, 0.50, 0.22, 0.40]
    module = benchmark_module()
    assert module.paired(a, b, 0.05)["equivalent_at_0_05"]
    assert not module.equivalence(a, b, 0.05)["equivalent_at_0_05"]


def test_paired_analysis_needs_pairs():
    with pytest.raises(ValueError, match="equal lengths"):
        benchmark_module().paired([0.1, 0.2, 0.3], [0.1, 0.2], 0.05)

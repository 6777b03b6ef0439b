"""Smoke test: benchmarks/vs_trl.py --quick runs our loop and TRL's GRPOTrainer on both
workloads and prints its JSON (skipped where trl, the `bench` extra, is not installed)."""

from __future__ import annotations

import pytest
from benchmark_runs import run_benchmark


@pytest.mark.slow
def test_quick_benchmark_runs_both_frameworks_on_both_workloads():
    pytest.importorskip("trl")
    out = run_benchmark("vs_trl.py", "--quick", timeout=1200)
    quick_tokens = 2 * 4 * 32  # prompts x n x max_new_tokens in --quick
    for workload in ("fixed", "variable"):
        result = out[workload]
        for side in ("ours", "trl"):
            assert result[side]["s_per_step_median"] > 0
            assert 0 < result[side]["completion_tokens_per_step_mean"] <= quick_tokens
        assert result["speedup_s_per_step"] == pytest.approx(
            result["trl"]["s_per_step_median"] / result["ours"]["s_per_step_median"]
        )
        # on-policy, one update per rollout: the old log-probs are the update's own
        assert all(kl == 0.0 for kl in result["ours"]["ppo_kl_first_update"])
    # fixed length: every sample of both frameworks is max_new_tokens long
    for side in ("ours", "trl"):
        assert out["fixed"][side]["completion_tokens_per_step_mean"] == quick_tokens
    # variable length: EOS ends most samples early, for both
    for side in ("ours", "trl"):
        assert out["variable"][side]["completion_tokens_per_step_mean"] < quick_tokens


def test_trl_with_vllm_records_a_missing_environment_instead_of_failing(tmp_path):
    import argparse

    from benchmarks import vs_trl

    args = argparse.Namespace(vllm_venv=tmp_path / "no-venv", verbose=False)
    out = vs_trl.run_trl(tmp_path, tmp_path, tmp_path / "data", args, True, "", use_vllm=True)
    assert out == {
        "error": f"{tmp_path / 'no-venv' / 'bin' / 'python'} not found: "
        "create it with benchmarks/vllm_env.py"
    }

"""benchmarks/prefill_attention_amx.py on a small shape: one JSON object with each head dim's
paired timings, where this CPU has AMX tiles (elsewhere it says there is nothing to compare)."""

from __future__ import annotations

import pytest
from benchmark_runs import benchmark_process, run_benchmark

from rollout import native

AMX = native.prefill() is not None and bool(native.prefill().prefill_attention_has_amx())


@pytest.mark.skipif(not AMX, reason="no AMX tiles here: the benchmark has nothing to compare")
def test_small_run_prints_paired_figures(tmp_path):
    out = run_benchmark(
        "prefill_attention_amx.py",
        *("--chunks", "2", "--prompt-len", "70", "--head-dims", "32,64", "--pairs", "2"),
        *("--threads", "1", "--out", str(tmp_path / "run.json")),
    )
    assert set(out["cases"]) == {"head_dim_32", "head_dim_64"}
    for case in out["cases"].values():
        assert case["amx_ms_median"] > 0 and case["avx512_ms_median"] > 0
        assert case["speedup_median"] > 0
        # the two paths differ by the probabilities' bfloat16 rounding and the outputs' (inputs
        # ~N(0, 1): outputs below ~3, a few bfloat16 ulps apart)
        assert case["max_abs_difference"] < 0.1
    assert (tmp_path / "run.json").exists()


@pytest.mark.skipif(AMX, reason="this CPU has AMX tiles")
def test_without_amx_it_says_so():
    proc = benchmark_process("prefill_attention_amx.py", "--pairs", "1")
    assert proc.returncode != 0 and "no AMX" in proc.stderr

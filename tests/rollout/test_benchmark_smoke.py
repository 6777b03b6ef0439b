"""Smoke test of `benchmarks/rollout_throughput.py --quick`: it runs end to end in a subprocess
and prints one JSON object with the documented keys, and `--out` writes the same result with the
run's date, machine, load average and command (`benchmarks/run_record.py`). Speed is not asserted
here (the full run is the benchmark); the token counts are, since they follow from the
workload."""

from __future__ import annotations

import datetime
import json
import os

from benchmark_runs import benchmark_process, run_benchmark

SCRIPT = "rollout_throughput.py"


def test_quick_benchmark_prints_json(tmp_path):
    before = datetime.datetime.now(datetime.UTC).replace(microsecond=0)
    out = run_benchmark(SCRIPT, "--quick", "--out", str(tmp_path / "run.json"))

    record = json.loads((tmp_path / "run.json").read_text())
    assert record["benchmark"] == "rollout_throughput" and record["result"] == out
    assert (
        before
        <= datetime.datetime.fromisoformat(record["date"])
        <= datetime.datetime.now(datetime.UTC)
    )
    assert record["command"] == (
        f"python benchmarks/{SCRIPT} --quick --out {tmp_path / 'run.json'}"
    )
    assert record["machine"]["cores"] == os.cpu_count() and record["machine"]["torch"]
    assert all(len(record["load_avg"][k]) == 3 for k in ("start", "end"))

    w = out["workload"]
    assert (w["prompts"], w["prompt_len"], w["n"], w["new_tokens"], w["quick"]) == (
        4,
        32,
        4,
        16,
        True,
    )
    expected_tokens = 4 * 4 * 16
    assert out["hf_generated_tokens"] == expected_tokens
    for key in ("engine", "engine_no_radix"):
        assert out[f"{key}_generated_tokens"] == expected_tokens
        assert out[f"{key}_all_samples_full_length"] is True
        assert out[f"{key}_tokens_per_s"] > 0 and out[f"{key}_seconds"] > 0
        assert out[f"ratio_{key}_vs_hf"] > 0
        stats = out[f"{key}_stats"]
        for stat in ("prefill_tokens_computed", "prefix_cache_hit_tokens", "preemptions"):
            assert isinstance(stats[stat], int), (key, stat, stats)
        assert stats["preemptions"] == 0
    assert out["hf_tokens_per_s"] > 0 and out["threads"] >= 1
    assert out["model"]["hidden_size"] == 256 and out["model"]["vocab_size"] == 4096
    # A request's n = 4 samples share one prefill of its prompt, with or without the radix cache.
    for key in ("engine", "engine_no_radix"):
        assert 0.9 * 4 * 32 <= out[f"{key}_stats"]["prefill_tokens_computed"] <= 1.1 * 4 * 32
    assert out["engine_no_radix_stats"]["prefix_cache_hit_tokens"] == 0
    for key in ("engine", "engine_no_radix"):  # fixed lengths: no tail, the busy share is real
        assert out[f"{key}_tail_s"] == 0.0
        assert 0.0 < out[f"{key}_busy_frac"] <= 1.0 and 0.0 < out[f"{key}_occupancy"] <= 1.0


def test_quick_benchmark_with_pareto_lengths():
    """`--lengths pareto:ALPHA`: each prompt's samples are exactly its drawn length (within
    [new_tokens / 8, new_tokens], recomputed here from the documented formula), HF is credited
    only those tokens, and the engines report their tail, busy share and occupancy."""
    import torch

    out = run_benchmark(SCRIPT, "--quick", "--lengths", "pareto:1.2")
    w = out["workload"]
    assert w["lengths"] == "pareto:1.2"
    g = torch.Generator().manual_seed(0 + 2)  # --seed 0
    u = 1.0 - torch.rand(4, generator=g, dtype=torch.float64)
    assert w["drawn_lengths"] == [min(16, int(2 / float(v) ** (1 / 1.2))) for v in u]
    assert all(2 <= n <= 16 for n in w["drawn_lengths"])
    expected_tokens = 4 * sum(w["drawn_lengths"])
    assert out["hf_generated_tokens"] == expected_tokens
    for key in ("engine", "engine_no_radix"):
        assert out[f"{key}_generated_tokens"] == expected_tokens
        assert out[f"{key}_all_samples_full_length"] is True  # each its own drawn length
        assert out[f"{key}_tail_s"] >= 0.0 and 0.0 <= out[f"{key}_tail_frac"] <= 1.0
        assert 0.0 < out[f"{key}_busy_frac"] <= 1.0 and 0.0 < out[f"{key}_occupancy"] <= 1.0


def test_lengths_option_rejects_a_bad_spec():
    proc = benchmark_process(SCRIPT, "--quick", "--lengths", "zipf:2", timeout=120)
    assert proc.returncode == 2
    assert "--lengths 'zipf:2': use fixed or pareto:ALPHA" in proc.stderr

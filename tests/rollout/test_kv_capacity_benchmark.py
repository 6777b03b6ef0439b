"""Smoke test of `benchmarks/kv_capacity.py --quick`: capacities follow from the pools' real
bytes (checked against the closed form 2 * layers * KV heads * head_dim * element size), FP8
holds at least 1.9x bfloat16's tokens per GiB (the acceptance bound; 2x exactly here, the
scales being per layer and head, not per token), and the decode section runs both pools. Speed
is not asserted (the box is shared)."""

from __future__ import annotations

from benchmark_runs import run_benchmark


def test_fp8_holds_twice_the_tokens_of_bf16():
    out = run_benchmark("kv_capacity.py", "--quick", "--budget-gib", "0.05", "--seq-len", "256")
    shape, cap = out["shape"], out["capacity"]
    for name, size in (("fp8_e4m3", 1), ("bfloat16", 2), ("float32", 4)):
        assert cap[name]["bytes_per_token"] == (
            2 * shape["layers"] * shape["kv_heads"] * shape["head_dim"] * size
        )
    assert cap["fp8_e4m3"]["tokens_per_gib_vs_bf16"] >= 1.9
    assert (
        cap["fp8_e4m3"]["max_concurrent_sequences"]
        >= 2 * cap["bfloat16"]["max_concurrent_sequences"] - 1
    )
    assert cap["bfloat16"]["max_concurrent_sequences"] > cap["float32"]["max_concurrent_sequences"]
    decode = out["decode"]
    assert (
        decode["fp8_e4m3"]["decode_tokens_per_s"] > 0
        and decode["bfloat16"]["decode_tokens_per_s"] > 0
    )
    assert decode["fp8_e4m3"]["kv_fp8_clipped_share"] < 0.01

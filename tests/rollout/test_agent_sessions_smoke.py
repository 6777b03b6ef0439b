"""Smoke test of `benchmarks/agent_sessions.py --quick`: two `python -m rollout.serving.server`
replica processes, the router front, sessions and the load phase, end to end, printing one JSON
object.
Hit rates and latencies are the benchmark's to measure; asserted here is what follows from the
workload: every request answered, and sessions served whole by one replica cache-aware."""

from __future__ import annotations

from benchmark_runs import run_benchmark


def test_quick_agent_sessions_benchmark_prints_json():
    out = run_benchmark("agent_sessions.py", "--quick")
    assert out["cache_aware"]["sessions_on_one_replica"] == out["workload"]["sessions"] == 4
    for policy in ("cache_aware", "round_robin"):
        assert 0 <= out[policy]["hit_rate_turns_ge_2"] <= 1
        assert out[policy]["hit_rate_by_turn"][0] == 0  # fresh random prompts: nothing cached
    load = out["load"]
    assert load["errors"] == 0 and load["lost"] == 0 and load["requests_ok"] > 0
    assert 0 < load["latency_p50_s"] <= load["latency_p99_s"]

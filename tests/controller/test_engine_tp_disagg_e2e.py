"""Engine TP over the broadcast transport: `trainer.tp=2 rollout.tp=2`, disaggregated on 4
devices (2 trainer ranks, one engine replica of 2 ranks). The resharding sync runs one broadcast
group per TP rank index (engine rank r with trainer TP rank r): after the run every engine
rank's parameters are bitwise equal to slices of the trainer's export, each trainer rank sent
exactly its slices, and the float64 bounds hold."""

from __future__ import annotations

import pytest
from engine_tp_runs import assert_ranks_hold_slices, run_tp_recipe

pytestmark = pytest.mark.slow


def test_tp2_engine_disaggregated_broadcast(ray_four, cache, tmp_path, monkeypatch):
    result = run_tp_recipe(
        tmp_path,
        monkeypatch,
        "trainer.updates_per_rollout=1",
        "trainer.tp=2",
        "cluster.devices=4",
        "cluster.colocate=false",
        "cluster.rollout_devices=2",
    )
    expected_bytes = assert_ranks_hold_slices(result)
    for r in result.rows:
        assert r["train/logprob_diff_max"] <= 1e-10
        assert abs(r["train/ppo_kl_first_update"]) <= 1e-12
        assert r["perf/weight_sync_bytes_per_rank"] == max(expected_bytes)
        assert r["perf/weight_sync_bytes"] == sum(expected_bytes)

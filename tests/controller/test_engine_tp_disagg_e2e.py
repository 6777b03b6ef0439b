"""Engine TP over the broadcast transport: `trainer.tp=2 rollout.tp=2`, disaggregated on 4
devices (2 trainer ranks, one engine replica of 2 ranks). The resharding sync runs one broadcast
group per TP rank index (engine rank r with trainer TP rank r): after the run every engine
rank's parameters are bitwise equal to slices of the trainer's export, each trainer rank sent
exactly its slices, and the float64 bounds hold.

The follower (engine rank 1) takes part in two communicators: its replica's TP group (every
forward, every command) and its weight-sync group. Each of its collectives is recorded with the
thread that issued it: all come from one thread (on GPUs two threads each driving an NCCL
communicator have no common order and can hang)."""

from __future__ import annotations

import pytest
import ray
from engine_tp_runs import assert_ranks_hold_slices, run_tp_recipe

from miles_like.run import placement
from miles_like.run.actors import RunActors

RECORDED = ("broadcast", "broadcast_object", "all_reduce", "all_gather", "all_gather_object")


def record_collective_threads(worker) -> None:
    """Runs inside an engine actor: every collective from now on is recorded as (function,
    issuing thread) in `worker.collective_threads`."""
    import threading

    import collectives

    worker.collective_threads = []
    for name in RECORDED:
        original = getattr(collectives, name)

        def recorded(*args, _name=name, _f=original, **kwargs):
            worker.collective_threads.append((_name, threading.get_ident()))
            return _f(*args, **kwargs)

        setattr(collectives, name, recorded)


def collective_threads(worker) -> list:
    return list(worker.collective_threads)


pytestmark = pytest.mark.slow


def test_tp2_engine_disaggregated_broadcast(ray_four, cache, tmp_path, monkeypatch):
    create_engines = placement.create_engines
    followers: list = []
    seen: list = []

    def recording_create_engines(*args, **kwargs):
        replicas = create_engines(*args, **kwargs)
        for ranks in replicas:
            ray.get([f.__ray_call__.remote(record_collective_threads) for f in ranks[1:]])
            followers.extend(ranks[1:])
        return replicas

    shutdown = RunActors.shutdown

    def read_then_shutdown(self, graceful=True):
        if graceful:
            seen.extend(ray.get([f.__ray_call__.remote(collective_threads) for f in followers]))
        shutdown(self, graceful)

    monkeypatch.setattr(placement, "create_engines", recording_create_engines)
    monkeypatch.setattr(RunActors, "shutdown", read_then_shutdown)
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
    assert len(seen) == 1  # one follower
    names = {name for name, _ in seen[0]}
    # the TP group's commands and forwards, and the sync group's broadcasts
    assert {"broadcast_object", "all_reduce", "broadcast"} <= names, names
    assert len({thread for _, thread in seen[0]}) == 1, seen[0]

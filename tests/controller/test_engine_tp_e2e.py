"""The RL loop with a tensor-parallel engine from the recipe: `trainer.tp=2 rollout.tp=2
cluster.devices=2`, colocated, the default recipe's first steps in float64 (real Ray actors).

Checked against references that share no code with the resharding sync:
* the float64 bounds of today: engine-vs-trainer `train/logprob_diff_max` <= 1e-10 and the first
  update's PPO-KL <= 1e-12 (the engine's shards must hold exactly the trainer's weights);
* after the last sync every engine rank's parameters are bitwise equal to slices of the
  trainer's full weights (its Hugging Face export), the slices written out from the layout
  rules in `tp_slices.py` (heads / rows / input columns halved, vocabulary rows in chunks of
  ceil(V / 2), norms whole);
* the bytes each trainer rank sent are exactly its engine rank's slices: no full tensor moved.
"""

from __future__ import annotations

import time

import pytest
from engine_tp_runs import assert_ranks_hold_slices, run_tp_recipe

from miles_like.run.actors import RunActors

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("trainer_tp", [2, 1])
def test_tp2_engine_colocated(ray_local, cache, tmp_path, monkeypatch, trainer_tp):
    """trainer.tp=2: the resharding sync (each trainer rank sends its engine rank's slices);
    trainer.tp=1 (data parallel 2): sizes differ, the full tensors go to engine rank 0, which
    hands each follower its slices: the same engine state, one rank sending everything."""
    result = run_tp_recipe(
        tmp_path,
        monkeypatch,
        "trainer.updates_per_rollout=2",
        f"trainer.tp={trainer_tp}",
        "cluster.devices=2",
    )
    assert [r["step"] for r in result.rows] == [0, 1]
    expected_bytes = assert_ranks_hold_slices(result)
    total_full = sum(t.numel() * t.element_size() for t in result.trainer_hf.values())
    for r in result.rows:
        assert r["train/logprob_diff_max"] <= 1e-10
        assert abs(r["train/ppo_kl_first_update"]) <= 1e-12
        if trainer_tp == 2:
            # each trainer rank sent exactly its engine rank's slices (no tensor whole but norms)
            assert r["perf/weight_sync_bytes_per_rank"] == max(expected_bytes)
            assert r["perf/weight_sync_bytes"] == sum(expected_bytes)
            assert r["perf/weight_sync_bytes_per_rank"] < 0.6 * total_full
        else:
            assert r["perf/weight_sync_bytes_per_rank"] == r["perf/weight_sync_bytes"]
            assert r["perf/weight_sync_bytes"] == total_full


def test_a_lost_follower_replaces_the_whole_replica(ray_local, cache, tmp_path, monkeypatch):
    """Right after the first sync engine rank 1 is killed: its rank 0 exits too (a replica lives
    and dies whole), the next rollout finds the replica dead and the controller replaces every
    rank; the run completes, still exact, and the new replica holds the trainer's weights."""
    import ray

    killed: list = []
    push = RunActors.push_weights

    def push_then_kill_a_follower(self, in_place=False):
        sent = push(self, in_place)
        if not killed:
            killed.extend(self.replicas[0])
            rank0, rank1 = self.replicas[0]
            ray.kill(rank1)
            with pytest.raises(ray.exceptions.RayActorError):  # rank 0 follows it
                for _ in range(600):
                    ray.get(rank0.ready.remote(), timeout=60)
                    time.sleep(0.1)
        return sent

    monkeypatch.setattr(RunActors, "push_weights", push_then_kill_a_follower)
    result = run_tp_recipe(
        tmp_path,
        monkeypatch,
        "trainer.updates_per_rollout=1",
        "trainer.tp=2",
        "cluster.devices=2",
    )
    assert [r["rollout/engine_restarts"] for r in result.rows] == [0, 1]
    assert all(r["train/logprob_diff_max"] <= 1e-10 for r in result.rows)
    assert all(a is not b for a, b in zip(killed, result.replica))
    assert_ranks_hold_slices(result)

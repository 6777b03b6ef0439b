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

import json
import time
from pathlib import Path

import pytest
from safetensors.torch import load_file
from tp_slices import digest, expected_slice

from miles_like.cli import main
from miles_like.loop import run
from miles_like.runtime import Runtime

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


@pytest.mark.parametrize("trainer_tp", [2, 1])
def test_tp2_engine_colocated(ray_local, cache, tmp_path, monkeypatch, trainer_tp):
    """trainer.tp=2: the resharding sync (each trainer rank sends its engine rank's slices);
    trainer.tp=1 (data parallel 2): sizes differ, the full tensors go to engine rank 0, which
    hands each follower its slices: the same engine state, one rank sending everything."""
    seen: dict = {}
    shutdown = Runtime.shutdown

    def observe_then_shutdown(self, graceful=True):
        # the state after the run's last sync, read from the live actors before they go
        if graceful and self.replicas:
            import ray

            self._save_hf(tmp_path / "trainer_hf")
            seen["digests"] = [ray.get([r.weight_digests.remote() for r in self.replicas[0]])]
        shutdown(self, graceful)

    monkeypatch.setattr(Runtime, "shutdown", observe_then_shutdown)
    out = tmp_path / "run"
    code = main(
        [
            str(ROOT / "recipes" / "tiny_arith_grpo.yaml"),
            f"tracking.output_dir={out}",
            "steps=2",
            "sft.steps=0",
            "rollout.prompts_per_step=4",
            "rollout.n=4",
            "rollout.kv_cache_tokens=1024",
            "trainer.updates_per_rollout=2",
            f"trainer.tp={trainer_tp}",
            "rollout.tp=2",
            "cluster.devices=2",
            "tracking.wandb_mode=disabled",
        ],
        run=run,
    )
    assert code == 0
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1]

    full = load_file(tmp_path / "trainer_hf" / "model.safetensors")
    (ranks,) = seen["digests"]
    assert len(ranks) == 2
    expected_bytes = []
    for rank, digests in enumerate(ranks):
        nbytes = 0
        for name, tensor in full.items():
            piece = expected_slice(name, tensor, 2, rank)
            assert digests[name] == digest(piece), f"rank {rank}: {name}"
            nbytes += piece.numel() * piece.element_size()
        assert set(digests) == set(full)
        expected_bytes.append(nbytes)
    total_full = sum(t.numel() * t.element_size() for t in full.values())
    for r in rows:
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

    seen: dict = {}
    sync, shutdown = Runtime.sync_weights, Runtime.shutdown

    def sync_then_kill_a_follower(self):
        sent = sync(self)
        if "killed" not in seen:
            seen["killed"] = self.replicas[0]
            rank0, rank1 = self.replicas[0]
            ray.kill(rank1)
            with pytest.raises(ray.exceptions.RayActorError):  # rank 0 follows it
                for _ in range(600):
                    ray.get(rank0.ready.remote(), timeout=60)
                    time.sleep(0.1)
        return sent

    def observe_then_shutdown(self, graceful=True):
        if graceful and self.replicas:
            self._save_hf(tmp_path / "trainer_hf")
            seen["replica"] = self.replicas[0]
            seen["digests"] = ray.get([r.weight_digests.remote() for r in self.replicas[0]])
        shutdown(self, graceful)

    monkeypatch.setattr(Runtime, "sync_weights", sync_then_kill_a_follower)
    monkeypatch.setattr(Runtime, "shutdown", observe_then_shutdown)
    out = tmp_path / "run"
    code = main(
        [
            str(ROOT / "recipes" / "tiny_arith_grpo.yaml"),
            f"tracking.output_dir={out}",
            "steps=2",
            "sft.steps=0",
            "rollout.prompts_per_step=4",
            "rollout.n=4",
            "rollout.kv_cache_tokens=1024",
            "trainer.updates_per_rollout=1",
            "trainer.tp=2",
            "rollout.tp=2",
            "cluster.devices=2",
            "tracking.wandb_mode=disabled",
        ],
        run=run,
    )
    assert code == 0
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["rollout/engine_restarts"] for r in rows] == [0, 1]
    assert all(r["train/logprob_diff_max"] <= 1e-10 for r in rows)
    assert all(a is not b for a, b in zip(seen["killed"], seen["replica"]))
    full = load_file(tmp_path / "trainer_hf" / "model.safetensors")
    for rank, digests in enumerate(seen["digests"]):
        for name, tensor in full.items():
            assert digests[name] == digest(expected_slice(name, tensor, 2, rank)), name

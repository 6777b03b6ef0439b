"""Engine TP over the broadcast transport: `trainer.tp=2 rollout.tp=2`, disaggregated on 4
devices (2 trainer ranks, one engine replica of 2 ranks). The resharding sync runs one broadcast
group per TP rank index (engine rank r with trainer TP rank r): after the run every engine
rank's parameters are bitwise equal to slices of the trainer's export, each trainer rank sent
exactly its slices, and the float64 bounds hold."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from safetensors.torch import load_file
from tp_slices import digest, expected_slice

from miles_like.cli import main
from miles_like.loop import run
from miles_like.runtime import Runtime

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


def test_tp2_engine_disaggregated_broadcast(ray_four, cache, tmp_path, monkeypatch):
    import ray

    seen: dict = {}
    shutdown = Runtime.shutdown

    def observe_then_shutdown(self, graceful=True):
        if graceful and self.replicas:
            self._save_hf(tmp_path / "trainer_hf")
            seen["digests"] = ray.get([r.weight_digests.remote() for r in self.replicas[0]])
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
            "trainer.updates_per_rollout=1",
            "trainer.tp=2",
            "rollout.tp=2",
            "cluster.devices=4",
            "cluster.colocate=false",
            "cluster.rollout_devices=2",
            "tracking.wandb_mode=disabled",
        ],
        run=run,
    )
    assert code == 0
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    full = load_file(tmp_path / "trainer_hf" / "model.safetensors")
    expected_bytes = []
    for rank, digests in enumerate(seen["digests"]):
        assert set(digests) == set(full)
        pieces = [expected_slice(name, t, 2, rank) for name, t in full.items()]
        for name, piece in zip(full, pieces):
            assert digests[name] == digest(piece), f"rank {rank}: {name}"
        expected_bytes.append(sum(p.numel() * p.element_size() for p in pieces))
    for r in rows:
        assert r["train/logprob_diff_max"] <= 1e-10
        assert abs(r["train/ppo_kl_first_update"]) <= 1e-12
        assert r["perf/weight_sync_bytes_per_rank"] == max(expected_bytes)
        assert r["perf/weight_sync_bytes"] == sum(expected_bytes)

"""The colocated step in the order a GPU run takes, on CPU.

On CPU the loop's trainer offload / onload do nothing, so a controller that asks the offloaded
critic for values (or the reference for log-probs) would go unseen until a GPU run. Here the
layout stages memory as it does colocated on GPUs (`Layout.staged_memory`): the trainer ranks
really offload and onload (their gradient buffers go and come back) and, like every rank, refuse
to compute while offloaded (`trainer_worker.OffloadedError`). A PPO run (critic values, GAE) with
a KL term in the reward (reference log-probs) completes only if both are asked for after the
onload; the controller's calls come in DESIGN.md's order, every step, the hand-over after
training staged (optimizer state offloaded, engine weights back, push, trainer weights offloaded,
then the engines' KV cache); each engine sizes its KV cache from a free-memory figure it measures
after the trainer's weights left, at every step; and after the run, with the trainer offloaded
again, the same values call is refused.

A checkpointing run with trainer TP 2 takes its checkpoints after the trainer offloaded: the
policy's TP shards are gathered from host memory; the checkpoint's weights must be exactly the
ones the engines received in the same step's push.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import ray
import torch

from miles_like.recipe.cli import main
from miles_like.run import placement
from miles_like.run.actors import RunActors
from miles_like.run.loop import run

RECIPE = str(Path(__file__).resolve().parents[2] / "recipes" / "tiny_arith_ppo.yaml")
pytestmark = pytest.mark.slow

STEP = [  # DESIGN.md, "One step of the loop", colocated
    "release_engines",
    "onload_trainer",
    "values",
    "ref_logprobs",
    "start_train",
    "offload_trainer_optimizer",
    "resume_engine_weights",
    "push_weights",
    "offload_trainer_weights",
    "alloc_engine_kv",
]


def test_critic_and_reference_are_asked_only_onloaded(ray_local, cache, tmp_path, monkeypatch):
    plan = placement.plan

    def staged_plan(*args):
        layout = plan(*args)
        assert layout.colocated and not layout.staged_memory  # colocated, on CPU
        return layout._replace(staged_memory=True)

    calls: list[str] = []
    batches: list = []
    weights_offloaded_at: list[float] = []
    kv_sizings: list[list[dict]] = []

    def record(name):
        method = getattr(RunActors, name)

        def recorded(self, *args, **kwargs):
            calls.append(name)
            if name == "values":
                batches.append(args[0])
            result = method(self, *args, **kwargs)
            if name == "offload_trainer_weights":
                weights_offloaded_at.append(time.time())
            if name == "alloc_engine_kv":
                kv_sizings.append(result)
            return result

        monkeypatch.setattr(RunActors, name, recorded)

    for name in STEP:
        record(name)
    refused: list[str] = []
    shutdown = RunActors.shutdown

    def ask_offloaded_then_shutdown(self, graceful=True):
        if graceful:  # the last step offloaded the trainer
            try:
                self.values(batches[-1])
            except ray.exceptions.RayTaskError as e:
                refused.append(str(e))
        shutdown(self, graceful)

    monkeypatch.setattr(placement, "plan", staged_plan)
    monkeypatch.setattr(RunActors, "shutdown", ask_offloaded_then_shutdown)
    out = tmp_path / "staged"
    code = main(
        [
            RECIPE,
            f"tracking.output_dir={out}",
            "steps=2",
            "rollout.prompts_per_step=4",
            "rollout.n=2",
            "sft.steps=0",
            "rollout.kv_cache_tokens=2048",
            "trainer.updates_per_rollout=1",
            "algorithm.kl_reward_coef=0.01",
            "tracking.wandb_mode=disabled",
        ],
        run=run,
    )
    assert code == 0
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1]
    assert all(r["perf/weight_sync_bytes"] > 0 for r in rows)
    assert calls == STEP * 2 + ["values"]
    # every engine measured the free memory it sized its KV cache from after the trainer's
    # weights had left, at every step, and got the recipe's 2048 tokens
    assert len(kv_sizings) == len(weights_offloaded_at) == 2
    for offloaded_at, sizings in zip(weights_offloaded_at, kv_sizings):
        assert sizings and all(s["measured_at"] > offloaded_at for s in sizings)
        assert all(s["free_bytes"] > 0 and s["pages"] * 4 == 2048 for s in sizings)
    assert min(s["measured_at"] for s in kv_sizings[1]) > max(
        s["measured_at"] for s in kv_sizings[0]
    )
    assert len(refused) == 1 and "OffloadedError" in refused[0], refused
    assert "values was asked while the rank is offloaded" in refused[0]


def _digests(path: Path) -> dict[str, str]:
    import hashlib

    from safetensors.torch import load_file

    return {
        name: hashlib.sha256(
            t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
        ).hexdigest()
        for name, t in load_file(path).items()
    }


def test_tp2_checkpoints_after_the_offload(ray_local, cache, tmp_path, monkeypatch):
    plan = placement.plan

    def staged_plan(*args):
        return plan(*args)._replace(staged_memory=True)

    engine_weights: list[dict] = []
    calls: list[str] = []
    push, offload = RunActors.push_weights, RunActors.offload_trainer_weights

    def push_and_read(self, in_place=False):
        calls.append("push_weights")
        sent = push(self, in_place)
        engine_weights.append(ray.get(self.engines[0].weight_digests.remote()))
        return sent

    def offload_recorded(self):
        calls.append("offload_trainer_weights")
        offload(self)

    monkeypatch.setattr(placement, "plan", staged_plan)
    monkeypatch.setattr(RunActors, "push_weights", push_and_read)
    monkeypatch.setattr(RunActors, "offload_trainer_weights", offload_recorded)
    out = tmp_path / "tp2"
    code = main(
        [
            str(Path(RECIPE).with_name("tiny_arith_grpo.yaml")),
            f"tracking.output_dir={out}",
            "steps=2",
            "rollout.prompts_per_step=4",
            "rollout.n=2",
            "rollout.kv_cache_tokens=2048",
            "trainer.updates_per_rollout=1",
            "sft.steps=0",
            "trainer.tp=2",
            "cluster.devices=2",
            "checkpoint.every_steps=1",
            "tracking.wandb_mode=disabled",
        ],
        run=run,
    )
    assert code == 0
    assert calls == ["push_weights", "offload_trainer_weights"] * 2
    saved = sorted((out / "checkpoints").glob("step_*"))
    assert [p.name for p in saved][-2:] == ["step_000001", "step_000002"]
    for ckpt, weights in zip(saved[-2:], engine_weights, strict=True):
        assert _digests(ckpt / "model.safetensors") == weights
        assert sorted(p.name for p in (ckpt / "trainer").iterdir()) == [
            "rank_00000.pt",
            "rank_00001.pt",
        ]

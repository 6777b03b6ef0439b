"""FP8 rollouts in the RL loop (`rollout.quantization: fp8` and `rollout.kv_cache_dtype: fp8_e4m3`,
with `algorithm.is_correction: tis`):
three colocated steps, memory staged as on GPUs (the engine's weights are released for training
and pushed back every step), the sender quantizing at sync time. After every push the engine's
FP8 weights and scales equal a fresh quantization of the trainer's weights of that step (the
step's checkpoint) bitwise, and every other weight equals the trainer's; the push moves fewer
bytes than the same run in float32 without quantization would. The FP8 KV pool's scales after
every push equal those of a fresh engine started from that step's checkpoint (quantized and
calibrated from scratch), bitwise: the calibration follows the weights through release / resume."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import ray
import torch
from safetensors.torch import load_file

from miles_like.recipe.cli import main
from miles_like.run import placement
from miles_like.run.actors import RunActors
from miles_like.run.loop import run
from quantization import is_quantized_weight, quantize, scale_name
from rollout import Engine, EngineConfig

RECIPE = str(Path(__file__).resolve().parents[2] / "recipes" / "tiny_arith_grpo.yaml")
pytestmark = pytest.mark.slow


def _digest(t: torch.Tensor) -> str:
    return hashlib.sha256(
        t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    ).hexdigest()


def _expected(checkpoint: Path) -> dict[str, str]:
    """The engine's parameters for the trainer's weights: linear ones quantized here."""
    out = {}
    for name, t in load_file(checkpoint / "model.safetensors").items():
        if is_quantized_weight(name):
            q = quantize(t)
            out[name], out[scale_name(name)] = _digest(q.weight), _digest(q.scale_inv)
        else:
            out[name] = _digest(t)
    return out


def _fresh_kv_scales(checkpoint: Path) -> tuple[torch.Tensor, torch.Tensor]:
    engine = Engine(
        EngineConfig(
            model_path=str(checkpoint),
            dtype="float32",
            quantization="fp8",
            kv_cache_dtype="fp8_e4m3",
            kv_cache_tokens=2048,
        )
    )
    return engine.pool.k_scale.clone(), engine.pool.v_scale.clone()


def test_engine_holds_the_trainers_weights_quantized(ray_local, cache, tmp_path, monkeypatch):
    plan = placement.plan
    engine_weights: list[dict] = []
    engine_kv_scales: list = []
    push = RunActors.push_weights

    def push_and_read(self, in_place=False):
        sent = push(self, in_place)
        engine_weights.append(ray.get(self.engines[0].weight_digests.remote()))
        engine_kv_scales.append(ray.get(self.engines[0].kv_scales.remote()))
        return sent

    monkeypatch.setattr(placement, "plan", lambda *a: plan(*a)._replace(staged_memory=True))
    monkeypatch.setattr(RunActors, "push_weights", push_and_read)
    out = tmp_path / "fp8"
    code = main(
        [
            RECIPE,
            f"tracking.output_dir={out}",
            "steps=3",
            "model.dtype=float32",
            "rollout.quantization=fp8",
            "rollout.kv_cache_dtype=fp8_e4m3",
            "algorithm.is_correction=tis",
            "rollout.prompts_per_step=4",
            "rollout.n=2",
            "rollout.kv_cache_tokens=2048",
            "trainer.updates_per_rollout=1",
            "sft.steps=0",
            "checkpoint.every_steps=1",
            "checkpoint.keep_last=3",
            "tracking.wandb_mode=disabled",
        ],
        run=run,
    )
    assert code == 0
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2]
    saved = sorted((out / "checkpoints").glob("step_*"))[-3:]
    assert [p.name for p in saved] == ["step_000001", "step_000002", "step_000003"]
    assert len(engine_weights) == 3
    for ckpt, weights, scales in zip(saved, engine_weights, engine_kv_scales, strict=True):
        assert weights == _expected(ckpt)
        k_scale, v_scale = _fresh_kv_scales(ckpt)
        assert torch.equal(scales[0], k_scale) and torch.equal(scales[1], v_scale)
    # the scales follow the weights: not all steps' calibrations can be the same numbers
    assert torch.isfinite(engine_kv_scales[0][0]).all()
    # the linear layers travel as FP8 + scales: well under the float32 bytes of the weights
    tensors = load_file(saved[0] / "model.safetensors")
    full = sum(t.numel() * t.element_size() for t in tensors.values())
    linear = sum(t.numel() for n, t in tensors.items() if is_quantized_weight(n))
    for r in rows:
        assert 0 < r["perf/weight_sync_bytes"] < full - 2 * linear
        # the engine samples from the rounded policy: the mismatch is there, and measured
        assert r["train/mismatch_kl"] > 0

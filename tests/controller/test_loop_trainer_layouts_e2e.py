"""The RL loop with the two trainer layouts that other tests take only at trainer level:
pipeline parallelism (`trainer.pp=2`) and the DeepSpeed backend. Each runs 2 steps of the
default recipe, scaled down, on real Ray actors on CPU, against the metrics contract and a
reference run of the layout the other loop tests already check:

* PP=2 (two stages, one layer each) against DP=2 on the same two devices, float64: the engines
  and the trainer agree to the float64 bound (1e-10) at both steps, so the weights pushed from
  both pipeline stages after the first update are exactly the trainer's; the first update's
  loss and gradient norm equal DP=2's to rounding, and the second rollout samples the same
  tokens (same seeds, same weights to rounding).
* DeepSpeed (ZeRO-2) against megatron, float32 (DeepSpeed has no float64 path): the engine and
  the trainer agree to the float32 bound the disaggregated loop test uses (1e-5) at both steps,
  and the first update's loss and gradient norm match megatron's to float32 rounding.

A reward that differs within every group (the response length), so the first update is never
zero and the second step sees the changed weights.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from miles_like.recipe.cli import main
from miles_like.run.loop import run
from miles_like.run.tracking import REQUIRED_KEYS

RECIPE = Path(__file__).resolve().parents[2] / "recipes" / "tiny_arith_grpo.yaml"
pytestmark = pytest.mark.slow

SMALL = (
    "steps=2",
    "rollout.prompts_per_step=4",
    "rollout.n=4",
    "sft.steps=30",
    "sft.batch_size=16",
    "rollout.kv_cache_tokens=2048",
    "trainer.updates_per_rollout=1",
    "reward.function=user_rewards:length_score",
    "tracking.wandb_mode=disabled",
)


@pytest.fixture
def user_rewards(monkeypatch):
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parent))


def train(out: Path, *overrides: str) -> list[dict]:
    assert main([str(RECIPE), f"tracking.output_dir={out}", *SMALL, *overrides], run=run) == 0
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def check_contract(rows: list[dict], logprob_bound: float) -> None:
    assert [r["step"] for r in rows] == [0, 1]
    for r in rows:
        assert set(REQUIRED_KEYS) <= r.keys()
        # the first update's old log-probs are its own forward's: ratio exactly 1
        assert r["train/ppo_kl_first_update"] == 0.0 and r["train/ratio_max"] == 1.0
        # engine vs trainer before the update; at step 1 after a weight push
        assert r["train/logprob_diff_max"] <= logprob_bound
        assert math.isfinite(r["train/grad_norm"]) and r["train/grad_norm"] > 0
        assert r["perf/weight_sync_bytes"] > 0


def test_pipeline_parallel_trainer_in_the_loop(ray_local, cache, tmp_path, user_rewards):
    two = ("cluster.devices=2",)
    pp = train(tmp_path / "pp2", *two, "trainer.pp=2")
    dp = train(tmp_path / "dp2", *two, "trainer.pp=1")
    check_contract(pp, logprob_bound=1e-10)
    check_contract(dp, logprob_bound=1e-10)
    # the same rollout at step 0 (same weights and seeds), so the same batch to train on
    for key in ("rollout/reward_mean", "rollout/response_len_mean", "rollout/samples"):
        assert pp[0][key] == dp[0][key], key
    assert pp[0]["train/loss"] == pytest.approx(dp[0]["train/loss"], rel=1e-9, abs=1e-12)
    assert pp[0]["train/grad_norm"] == pytest.approx(dp[0]["train/grad_norm"], rel=1e-9)
    # after one update, equal to rounding, the engines sample the same tokens again
    for key in ("rollout/reward_mean", "rollout/response_len_mean"):
        assert pp[1][key] == dp[1][key], key


def test_deepspeed_trainer_in_the_loop(ray_local, cache, tmp_path, user_rewards):
    f32 = ("model.dtype=float32",)
    ds = train(tmp_path / "ds", *f32, "trainer.backend=deepspeed", "trainer.zero_stage=2")
    mg = train(tmp_path / "mg", *f32, "trainer.backend=megatron")
    check_contract(ds, logprob_bound=1e-5)
    check_contract(mg, logprob_bound=1e-5)
    for key in ("rollout/reward_mean", "rollout/response_len_mean", "rollout/samples"):
        assert ds[0][key] == mg[0][key], key
    assert ds[0]["train/loss"] == pytest.approx(mg[0]["train/loss"], rel=1e-4, abs=1e-6)
    assert ds[0]["train/grad_norm"] == pytest.approx(mg[0]["train/grad_norm"], rel=1e-4)

"""The busy / idle metrics of a real run: Ray actors on CPU, 2 steps.

The reward sleeps a known time per sample in one worker, with no engine or trainer computing,
so the step's device-idle share must cover at least that sleep; the trainer's compute intervals,
recorded inside its actor, must fit inside the controller's own train + advantages phase timers;
every share is in [0, 1]."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from miles_like.recipe.cli import main
from miles_like.run.loop import run

import user_rewards

RECIPE = str(Path(__file__).resolve().parents[2] / "recipes" / "tiny_arith_grpo.yaml")
pytestmark = pytest.mark.slow

FRACTIONS = (
    "perf/engine_busy_frac",
    "perf/engine_busy_frac_min",
    "perf/engine_occupancy",
    "perf/rollout_tail_frac",
    "perf/trainer_busy_frac",
    "perf/device_idle_frac",
)


def test_idle_covers_a_sleeping_reward(ray_local, cache, tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parent))
    out = tmp_path / "run"
    code = main(
        [
            RECIPE,
            f"tracking.output_dir={out}",
            "steps=2",
            "rollout.prompts_per_step=4",
            "rollout.n=4",
            "sft.steps=0",
            "rollout.kv_cache_tokens=2048",
            "trainer.updates_per_rollout=1",
            "reward.function=user_rewards:sleepy_length_score",
            "reward.max_workers=1",
        ],
        run=run,
    )
    assert code == 0
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1]
    sleep = 16 * user_rewards.SLEEP_S  # 16 samples scored one after another
    for r in rows:
        for key in FRACTIONS:
            assert 0.0 <= r[key] <= 1.0, (key, r[key])
        assert r["perf/engine_busy_frac"] > 0 and r["perf/engine_occupancy"] > 0
        assert r["perf/engine_busy_frac_min"] == r["perf/engine_busy_frac"]  # one engine
        assert r["perf/rollout_tail_s"] >= 0
        assert r["perf/device_idle_frac"] * r["perf/step_s"] >= sleep
        trainer_s = r["perf/trainer_busy_frac"] * r["perf/step_s"]
        assert 0 < trainer_s <= r["perf/train_s"] + r["perf/advantages_s"]
        # the reward's sleep is inside a timed phase (the rollout's scoring): the controller's
        # own overhead, the step outside its phases, stays well below it and small in the step
        assert r["perf/idle_s"] < min(sleep, 0.1 * r["perf/step_s"])
    # step 0's rollout was launched as the step began: all of its scoring is in the phase
    assert rows[0]["perf/rollout_s"] > sleep

"""A run of the real loop with a reward that hangs, kills its worker and returns NaN on some
responses (`unruly_rewards:arith_or_misbehave`): it completes, and every failure is counted."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from miles_like.recipe.cli import main
from miles_like.run.loop import run

RECIPE = Path(__file__).resolve().parents[2] / "recipes" / "tiny_arith_grpo.yaml"
pytestmark = pytest.mark.slow


def test_a_run_with_a_misbehaving_reward_completes(ray_local, cache, tmp_path):
    out = tmp_path / "unruly"
    start = time.monotonic()
    code = main(
        [
            str(RECIPE),
            f"tracking.output_dir={out}",
            "steps=2",
            "rollout.prompts_per_step=4",
            "rollout.n=4",
            "sft.steps=30",
            "sft.batch_size=16",
            "rollout.kv_cache_tokens=2048",
            "trainer.updates_per_rollout=1",
            "reward.function=unruly_rewards:arith_or_misbehave",
            "reward.timeout_s=2",
            "reward.max_workers=4",
        ],
        run=run,
    )
    seconds = time.monotonic() - start
    assert code == 0
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1]
    # responses starting with 1 hang, with 2 kill their worker, with 3 are NaN: all seen, all 0
    assert sum(r["rollout/reward_timeouts"] for r in rows) > 0
    assert sum(r["rollout/reward_errors"] for r in rows) > 0
    assert sum(r["rollout/reward_nan"] for r in rows) > 0
    assert seconds < 600  # an hour-long hang per call would otherwise stall it

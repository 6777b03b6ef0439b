"""A multi-turn rollout function through the real loop (Ray actors on CPU, float64): the
trainer's log-probs of the sampled tokens equal the engine's to float64 rounding, over exactly
the loss-masked tokens (a mask that let in one appended token would show its engine log-prob of
0 against the trainer's), and the step's metrics are those of the recorded trajectories. The
run also serves the HTTP endpoint (`rollout.serve_http`), whose window must not disturb it."""

from __future__ import annotations

import json
from pathlib import Path

import agent_rollouts
import pytest

from miles_like.recipe.cli import main
from miles_like.run.loop import run

ROOT = Path(__file__).resolve().parents[2]
RECIPE = str(ROOT / "recipes" / "tiny_arith_grpo.yaml")
pytestmark = pytest.mark.slow

PROMPTS, N = 2, 2


def test_three_turn_run_trains_on_exactly_the_sampled_tokens(ray_local, cache, tmp_path, capsys):
    agent_rollouts.RECORDS.clear()
    out = tmp_path / "run"
    code = main(
        [
            RECIPE,
            f"tracking.output_dir={out}",
            "steps=2",
            f"rollout.prompts_per_step={PROMPTS}",
            f"rollout.n={N}",
            "rollout.max_new_tokens=6",
            "rollout.kv_cache_tokens=2048",
            "sft.steps=10",
            "sft.batch_size=16",
            "trainer.updates_per_rollout=1",
            "rollout.function=agent_rollouts:three_turns",
            "rollout.max_turns=3",
            "rollout.serve_http=true",
        ],
        run=run,
    )
    assert code == 0
    # the endpoint's window opens for every rollout and lifecycle calls close it again
    assert (
        "rollout.serve_http: OpenAI-compatible router at http://127.0.0.1:"
        in capsys.readouterr().out
    )
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1]
    per_step = PROMPTS * N
    assert len(agent_rollouts.RECORDS) == 2 * per_step
    for step, r in enumerate(rows):
        recs = agent_rollouts.RECORDS[step * per_step : (step + 1) * per_step]
        sampled = sum(len(s) for rec in recs for s in rec.sampled)
        total = sum(rec.trajectory.response_len for rec in recs)
        assert r["rollout/samples"] == per_step and r["rollout/turns_mean"] == 3.0
        assert r["rollout/loss_mask_frac"] == pytest.approx(sampled / total, abs=1e-12)
        assert r["rollout/response_len_mean"] == pytest.approx(total / per_step, abs=1e-12)
        assert r["rollout/generated_tokens"] == sampled
        assert r["rollout/prefix_cache_hit_rate_turn2plus"] > 0.5
        assert r["train/logprob_diff_max"] <= 1e-10
        assert r["train/ppo_kl"] == 0.0 and r["train/ratio_max"] == 1.0
        # every trajectory's weight version is the engine's at that step (one sync per step)
        assert {
            v
            for rec in recs
            for v, m in zip(rec.trajectory.weight_versions, rec.trajectory.loss_mask)
            if m
        } == {step}

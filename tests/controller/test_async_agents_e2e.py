"""Multi-turn rollout functions in fully asynchronous training (`rollouts/agents.py`), end to end
on Ray with `agent_rollouts:three_turns` (three model turns per sample, a deterministic tool
message between them; each trajectory recorded).

* max_staleness 0: one batch at a time under the current weights, as in the synchronous loop:
  the trainer's log-probs of exactly the loss-masked tokens equal the engine's, every
  sampled token has the step's version, each step trains the next prompts_per_step prompts.
* max_staleness 1, with `agent_rollouts:three_turns_across_updates` (a group drawn under
  updated weights waits, between its first and second turn, for the next update, as a slow
  tool would, so it holds tokens at an update whatever the speed of engine and trainer): such
  groups are continued across the update and their trajectories hold tokens of two versions,
  each token with the version that sampled it, in order; no trained group is staler than the
  bound (its oldest token), and every drawn prompt is trained, dropped or held exactly once.
* Kill -9 mid-run and resume, with dynamic sampling on: the accounting is exact across it
  (groups running at the checkpoint restart from their prompts, buffered ones keep their
  trajectories, filtered ones stay counted), and every trained group is informative.
* A rollout function that returns a broken trajectory stops the run with the synchronous
  loop's one line (exit code 1).
"""

from __future__ import annotations

import agent_rollouts
import pytest
from test_async_dynamic_e2e import filtered_ids
from test_async_e2e import (
    ASYNC,
    BASE,
    PROMPTS,
    check_accounting,
    killed_and_resumed,
    run_in_process,
)
from test_resume_e2e import RECIPE

from miles_like.recipe.cli import main
from miles_like.run.loop import run

pytestmark = pytest.mark.slow

AGENTS = (
    *ASYNC,
    "rollout.function=agent_rollouts:three_turns",
    "rollout.max_turns=3",
    "rollout.kv_cache_tokens=8192",
)


def sampled_versions(t) -> list[int]:
    return [v for v, m in zip(t.weight_versions, t.loss_mask) if m]


def test_zero_staleness_agents_train_on_the_engines_tokens(ray_local, cache, tmp_path):
    agent_rollouts.RECORDS.clear()
    rows = run_in_process(
        tmp_path / "zero",
        "steps=3",
        "checkpoint.every_steps=0",
        "rollout.max_new_tokens=6",
        *AGENTS,
        "cluster.max_staleness=0",
    )
    assert len(check_accounting(rows)) == 3 * PROMPTS
    for r in rows:
        step = r["step"]
        assert r["rollout/trained_prompt_ids"] == list(range(step * PROMPTS, (step + 1) * PROMPTS))
        assert r["rollout/turns_mean"] == 3.0 and r["rollout/staleness_max"] == 0
        # float64 engine and trainer agree far below this; one appended (unsampled) token in
        # the mask would differ by its trainer log-prob, order 1
        assert r["train/logprob_diff_max"] <= 1e-6
        assert r["train/ppo_kl"] == 0.0 and r["train/ratio_max"] == 1.0
    records = agent_rollouts.RECORDS
    assert len(records) == 3 * PROMPTS * 2
    by_prompt = {}
    for rec in records:  # each prompt's samples ran under one version: the step's
        by_prompt.setdefault(rec.prompt, set()).update(sampled_versions(rec.trajectory))
    assert all(len(v) == 1 for v in by_prompt.values())
    assert {v for vs in by_prompt.values() for v in vs} == {0, 1, 2}


def test_agents_run_across_weight_updates_within_the_bound(ray_local, cache, tmp_path):
    agent_rollouts.RECORDS.clear()
    rows = run_in_process(
        tmp_path / "one",
        "steps=4",
        "checkpoint.every_steps=0",
        "rollout.max_new_tokens=48",
        "reward.function=user_rewards:length_score",
        *AGENTS,
        "rollout.function=agent_rollouts:three_turns_across_updates",
        "cluster.max_staleness=1",
    )
    assert len(check_accounting(rows)) == 4 * PROMPTS
    assert all(r["rollout/staleness_max"] <= 1 for r in rows)
    assert sum(r["rollout/continued_groups"] for r in rows) > 0
    for r in rows:  # the oldest token of each trained group: at most one version old
        trained_at = r["step"]
        assert all(trained_at - 1 <= v <= trained_at for v in r["rollout/trained_prompt_versions"])
    # a group open at an update was continued under the new weights: its trajectory holds the
    # tokens of both versions, each with its own version recorded, in order
    mixed = [
        rec for rec in agent_rollouts.RECORDS if len(set(sampled_versions(rec.trajectory))) > 1
    ]
    assert mixed
    for rec in agent_rollouts.RECORDS:
        versions = sampled_versions(rec.trajectory)
        assert versions == sorted(versions)
        assert len(versions) == sum(len(s) for s in rec.sampled)  # the mask: sampled tokens only


STEPS = 6


def test_killed_async_agent_run_with_dynamic_sampling_resumes_exactly(ray_local, cache, tmp_path):
    out = tmp_path / "killed"
    overrides = (
        f"steps={STEPS}",
        "checkpoint.every_steps=2",
        "checkpoint.keep_last=100",
        "rollout.max_new_tokens=24",
        *AGENTS,
        "cluster.max_staleness=1",
        "algorithm.dynamic_sampling=true",
        "algorithm.dynamic_sampling_max_rounds=100",
        "reward.function=user_rewards:parity_score",
    )
    rows = killed_and_resumed(out, overrides, every=2)
    assert all(r["rollout/turns_mean"] == 3.0 for r in rows)
    # some groups were filtered (their rewards all equal), across the kill too, and every
    # trained one was informative: rewards {0, 1} on n = 2, standard deviation exactly 0.5
    assert filtered_ids(rows)
    assert [r["rollout/reward_group_std_mean"] for r in rows] == [0.5] * STEPS


def test_a_failing_rollout_function_stops_the_async_run(ray_local, cache, tmp_path, capsys):
    code = main(
        [
            RECIPE,
            f"tracking.output_dir={tmp_path / 'raises'}",
            *BASE,
            "steps=2",
            "checkpoint.every_steps=0",
            *ASYNC,
            "rollout.function=agent_rollouts:bad_mask",
        ],
        run=run,
    )
    assert code == 1
    (line,) = [x for x in capsys.readouterr().err.splitlines() if x.startswith("error:")]
    assert line.startswith("error: rollout.function='agent_rollouts:bad_mask' failed on the prompt")
    assert "ValueError: trajectory 0: loss_mask has" in line  # `functions.check_group`

"""Over-sampling, partial rollouts and streaming scoring, end to end on Ray (`oversampling.py`).

* Streaming: scoring each group as it completes (a slow reward, one reward worker) gives
  exactly the metrics of scoring at the end, every key but timings (the overlap itself is
  measured where the lengths are controlled: test_streaming_scoring.py).
* Abort: the batch is prompts_per_step complete groups, the rest are dropped and counted.
* Retract + kill -9: a run with partial groups carried over is SIGKILLed mid-step (after a
  checkpoint, not at one) and resumed with checkpoint.resume=auto: every metrics.jsonl key but
  the timings equals an uninterrupted run (float64), and the carried samples really were
  continued (staleness 1 on trained tokens, carried unfinished samples counted). Also on the
  built-in mixture of experts with routing replay: the replayed routes of the carried samples
  survive (the routing agreement, log-probs and gradients of the resumed run are the same).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from killed_run import killed_run
from test_resume_e2e import COMMON, RECIPE, is_timing, rows_of

from miles_like.recipe.cli import main
from miles_like.run.loop import run
from miles_like.scoring.rewards import compute_rewards, resolve_reward

pytestmark = pytest.mark.slow

# responses that end at varied lengths (a brevity reward, T < 1, room to run long), so groups
# complete at different engine steps and the ones left over are really cut mid-sample
OVER = (
    "rollout.over_sampling=2",
    "rollout.n=2",
    "rollout.max_new_tokens=40",
    "rollout.temperature=0.8",
    "reward.function=user_rewards:brevity_score",
)


def run_in_process(out: Path, *overrides: str) -> list[dict]:
    assert main([RECIPE, f"tracking.output_dir={out}", *COMMON, *overrides], run=run) == 0
    return rows_of(out)


def same_rows(a_rows: list[dict], b_rows: list[dict]) -> None:
    assert len(a_rows) == len(b_rows)
    for a, b in zip(a_rows, b_rows):
        keys = {k for k in a.keys() | b.keys() if not is_timing(k)}
        diff = {k: (a.get(k), b.get(k)) for k in sorted(keys) if a.get(k) != b.get(k)}
        assert not diff, f"step {a['step']}: {diff}"


def test_streaming_scoring_is_exact(ray_local, cache, tmp_path):
    slow = (
        "steps=2",
        "checkpoint.every_steps=0",
        "rollout.max_new_tokens=128",
        "rollout.temperature=0.8",
        "rollout.prompts_per_step=8",
        "rollout.n=2",
        "reward.function=user_rewards:slow_brevity_score",
        "reward.max_workers=1",
    )
    # the reward pool is the process's, started on first use: start it before either run
    result = compute_rewards(
        resolve_reward("user_rewards:slow_brevity_score"), ["p"], ["r"], ["a"], max_workers=1
    )
    assert result.scores == [-1.0]
    at_end = run_in_process(tmp_path / "at_end", *slow)
    streamed = run_in_process(tmp_path / "streamed", *slow, "rollout.stream_scoring=true")
    same_rows(streamed, at_end)


def test_abort_trains_complete_groups_and_drops_the_rest(ray_local, cache, tmp_path):
    rows = run_in_process(
        tmp_path / "abort", "steps=2", "checkpoint.every_steps=0", *OVER, "rollout.partial=abort"
    )
    for r in rows:
        assert r["rollout/samples"] == 4 * 2  # prompts_per_step x n complete samples trained
        assert r["rollout/launched_groups"] == 8  # 4 x 2, all fresh: nothing carried
        assert r["rollout/aborted_groups"] == 4 and r["rollout/carried_groups"] == 0
        assert r["rollout/staleness_max"] == 0 and r["rollout/continued_groups"] == 0
    assert sum(r["rollout/aborted_samples"] for r in rows) > 0  # some were cut mid-sample


STEPS = 6
KILL_AFTER = 3  # checkpoint step_000003 complete, then killed mid step 3
DELAY_S = 0.3  # steps take ~0.3-1 s on a quiet box: well inside the run either way


# the built-in mixture of experts with routing replay (its default): the carried samples' routes
# are kept across the steps, the kill and the resume (`sample_routes`)
MOE = ("model.builtin=tiny-qwen3-moe",)


@pytest.mark.parametrize("model", [(), MOE], ids=["dense", "moe"])
def test_retract_kill9_mid_step_and_resume_is_exact(ray_local, cache, tmp_path, capsys, model):
    over = (*OVER, "rollout.partial=retract", *model)
    reference, killed = tmp_path / "reference", tmp_path / "killed"
    marker = killed / "checkpoints" / f"step_{KILL_AFTER:06d}" / "state.json"
    # into step KILL_AFTER: not at a checkpoint
    with killed_run(killed, [RECIPE, *COMMON, *over], marker, delay_s=DELAY_S) as kill:
        ref_rows = run_in_process(reference, *over)
    assert kill.rows_at_kill and KILL_AFTER <= kill.rows_at_kill[0] < STEPS, "not killed mid-run"
    capsys.readouterr()
    resumed = run_in_process(killed, "checkpoint.resume=auto", *over)
    printed = capsys.readouterr().out
    assert "resume: continuing from " in printed
    # partial samples were in flight and continued under newer weights
    assert any(r["rollout/carried_samples"] > 0 for r in ref_rows)
    assert any(r["rollout/staleness_max"] >= 1 for r in ref_rows)
    assert any(r["rollout/continued_groups"] > 0 for r in ref_rows)
    assert all(r["train/grad_norm"] > 0 for r in ref_rows)
    assert [r["step"] for r in resumed] == list(range(STEPS))
    same_rows(resumed, ref_rows)
    if model:  # every trained token replayed its engine route; the routes survived the kill
        for r in ref_rows:
            assert r["train/ppo_kl_first_update"] == 0.0 and r["rollout/route_bytes"] > 0
            if r["rollout/continued_groups"] == 0:  # else tokens of older weights: a lag
                assert r["train/logprob_diff_max"] <= 1e-10
        assert any(r["rollout/continued_groups"] == 0 for r in ref_rows)

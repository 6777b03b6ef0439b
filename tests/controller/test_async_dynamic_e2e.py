"""Dynamic sampling (DAPO) in fully asynchronous training, end to end on Ray.

A buffered group whose rewards are all equal is not trained: it is filtered as soon as it is
scored, counted (`rollout/dynamic_dropped_groups`, `rollout/dynamic_filtered_prompt_ids`), and
its room is drawn again, so every batch is full of informative groups; at most
`dynamic_sampling_max_rounds x prompts_per_step` are filtered per batch (then groups are
trained as they are, as the synchronous loop trains on what there is after its last round).

* `user_rewards:parity_score` on n = 2: an informative group has rewards {0, 1}, standard
  deviation exactly 0.5, so `rollout/reward_group_std_mean == 0.5` says every trained group
  was informative; about half the groups are not, so some are filtered.
* `user_rewards:constant_score`: no group is informative; the first batch comes after exactly
  the budget was filtered, and no batch filters more.
* Kill -9 mid-run and resume: every drawn prompt is trained, dropped, filtered or held once
  (the filtered-but-not-yet-reported indices are part of the checkpoint).
"""

from __future__ import annotations

import pytest
from killed_run import killed_run
from test_async_e2e import ASYNC, BASE, PROMPTS, check_accounting, run_in_process
from test_resume_e2e import RECIPE

pytestmark = pytest.mark.slow

DYNAMIC = (
    *ASYNC,
    "cluster.max_staleness=1",
    "algorithm.dynamic_sampling=true",
    "rollout.max_new_tokens=24",
)


def filtered_ids(rows: list[dict]) -> list[int]:
    for r in rows:
        assert r["rollout/dynamic_dropped_groups"] == len(r["rollout/dynamic_filtered_prompt_ids"])
        assert r["rollout/dynamic_kept_groups"] == PROMPTS
    return [i for r in rows for i in r["rollout/dynamic_filtered_prompt_ids"]]


def test_async_dynamic_sampling_trains_informative_groups_only(ray_local, cache, tmp_path):
    rows = run_in_process(
        tmp_path / "parity",
        "steps=4",
        "checkpoint.every_steps=0",
        *DYNAMIC,
        "reward.function=user_rewards:parity_score",
        "algorithm.dynamic_sampling_max_rounds=100",  # never reached: every group judged
    )
    assert [r["rollout/reward_group_std_mean"] for r in rows] == [0.5] * len(rows)
    # P(no group of the >= 16 drawn has equal rewards) ~ 2^-16 at the reward's odds of 1/2
    assert filtered_ids(rows)
    assert len(check_accounting(rows)) == 4 * PROMPTS


def test_async_dynamic_sampling_filters_at_most_its_budget(ray_local, cache, tmp_path):
    rows = run_in_process(
        tmp_path / "constant",
        "steps=3",
        "checkpoint.every_steps=0",
        *DYNAMIC,
        "reward.function=user_rewards:constant_score",
        "algorithm.dynamic_sampling_max_rounds=1",
    )
    filtered_ids(rows)
    assert rows[0]["rollout/dynamic_dropped_groups"] == PROMPTS  # nothing else could be taken
    assert all(r["rollout/dynamic_dropped_groups"] <= PROMPTS for r in rows)
    assert all(r["rollout/reward_group_std_mean"] == 0.0 for r in rows)
    check_accounting(rows)


STEPS = 8


def test_killed_async_dynamic_run_resumes_exactly(ray_local, cache, tmp_path):
    out = tmp_path / "killed"
    overrides = (
        f"steps={STEPS}",
        "checkpoint.every_steps=2",
        "checkpoint.keep_last=100",
        *DYNAMIC,
        "reward.function=user_rewards:parity_score",
        "algorithm.dynamic_sampling_max_rounds=100",
    )
    marker = out / "checkpoints" / "step_000002" / "state.json"
    with killed_run(out, [RECIPE, *BASE, *overrides], marker, delay_s=0.3) as kill:
        pass
    assert kill.rows_at_kill and 2 <= kill.rows_at_kill[0] < STEPS, "not killed mid-run"
    rows = run_in_process(out, *overrides, "checkpoint.resume=auto")
    assert [r["step"] for r in rows] == list(range(STEPS))
    filtered = filtered_ids(rows)
    assert filtered
    assert len(check_accounting(rows)) == STEPS * PROMPTS
    assert [r["rollout/reward_group_std_mean"] for r in rows] == [0.5] * STEPS

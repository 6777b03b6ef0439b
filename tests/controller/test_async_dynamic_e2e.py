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
* Kill -9 mid-run and resume (in `test_async_agents_e2e.py`, with multi-turn rollouts): every
  drawn prompt is trained, dropped, filtered or held once (the filtered-but-not-yet-reported
  indices are part of the checkpoint).
"""

from __future__ import annotations

import pytest
from test_async_e2e import ASYNC, PROMPTS, check_accounting, run_in_process

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

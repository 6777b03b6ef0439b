"""`rollout.partial: in_place` and `rollout.max_carry_versions`, end to end on Ray
(disaggregated: one engine, one trainer; `oversampling.py`).

* in_place vs retract from the same start: step 0 (nothing carried yet) is the same run, every
  key but timings; afterwards the carried samples continue on the K/V the engine parked across
  the weight update (`rollout/in_place_reused_tokens` > 0: those tokens were not prefilled
  again), with staleness >= 1 on trained tokens, and training goes on (grad norm > 0).
* resume from a checkpoint of the in_place run, before a step that continued on parked K/V:
  the steps before it are the same run (the checkpoint's row); the parked K/V is gone with the
  old engine, so that step's carried samples prefill as retract does (reused tokens 0); what
  they sample from there on may differ (K/V recomputed by the new weights).
* max_carry_versions=0 with retract carries nothing: every left-over group is dropped and
  counted as stale, the same batch as partial: abort makes.
"""

from __future__ import annotations

import pytest
from test_oversampling_e2e import OVER, run_in_process, same_rows
from test_resume_e2e import is_timing

pytestmark = pytest.mark.slow

DISAGG = ("cluster.colocate=false", "cluster.devices=2", "steps=4")
IN_PLACE_ONLY = "rollout/in_place_reused_tokens"


def _without(rows: list[dict], *keys: str) -> list[dict]:
    return [{k: v for k, v in r.items() if k not in keys} for r in rows]


def test_in_place_continues_on_parked_kv_and_resumes_as_retract(ray_local, cache, tmp_path):
    base = (*OVER, *DISAGG)
    retract = run_in_process(
        tmp_path / "retract", *base, "checkpoint.every_steps=0", "rollout.partial=retract"
    )
    in_place = run_in_process(
        tmp_path / "in_place",
        *base,
        "checkpoint.every_steps=1",
        "checkpoint.keep_last=4",
        "rollout.partial=in_place",
    )
    same_rows(_without(in_place[:1], IN_PLACE_ONLY), retract[:1])
    assert in_place[0][IN_PLACE_ONLY] == 0  # nothing carried into step 0
    assert any(r[IN_PLACE_ONLY] > 0 for r in in_place[1:])
    assert any(r["rollout/carried_samples"] > 0 for r in in_place)
    assert any(r["rollout/continued_groups"] > 0 for r in in_place)
    assert any(r["rollout/staleness_max"] >= 1 for r in in_place)
    assert all(r["train/grad_norm"] > 0 for r in in_place)
    # the two partial modes continue the same groups; only the K/V under their tokens differs
    assert [r["rollout/launched_groups"] for r in in_place] == [
        r["rollout/launched_groups"] for r in retract
    ]
    # resume before the last step that continued on parked K/V
    last = max(r["step"] for r in in_place if r[IN_PLACE_ONLY] > 0)
    ckpt = tmp_path / "in_place" / "checkpoints" / f"step_{last:06d}"
    assert (ckpt / "state.json").exists()
    resumed = run_in_process(
        tmp_path / "resumed", *base, "rollout.partial=in_place", f"checkpoint.resume={ckpt}"
    )
    assert [r["step"] for r in resumed] == list(range(last - 1, 4))  # the checkpoint's row first
    assert resumed[0] == in_place[last - 1]
    at, again = in_place[last], resumed[1]
    assert again[IN_PLACE_ONLY] == 0  # the parked K/V died with the old engine: retract
    # the same groups go on (from the checkpoint); which complete first may differ now
    assert again["rollout/launched_groups"] == at["rollout/launched_groups"]
    assert {k for k in at if not is_timing(k)} == {k for k in again if not is_timing(k)}


def test_max_carry_versions_zero_drops_every_left_over_group(ray_local, cache, tmp_path):
    base = (*OVER, "steps=2", "checkpoint.every_steps=0")
    bounded = run_in_process(
        tmp_path / "bounded", *base, "rollout.partial=retract", "rollout.max_carry_versions=0"
    )
    aborted = run_in_process(tmp_path / "aborted", *base, "rollout.partial=abort")
    for r in bounded:
        assert r["rollout/carried_groups"] == 0 and r["rollout/continued_groups"] == 0
        assert r["rollout/stale_dropped_groups"] == 4  # 8 launched, 4 in the batch
    # the same batches as abort: the run is the same but for the counters' names
    renamed = {"rollout/stale_dropped_groups", "rollout/stale_dropped_samples"}
    moved = {"rollout/aborted_groups", "rollout/aborted_samples"}
    same_rows(_without(bounded, *renamed, *moved), _without(aborted, *moved))
    for b, a in zip(bounded, aborted):
        assert b["rollout/stale_dropped_groups"] == a["rollout/aborted_groups"]
        assert b["rollout/stale_dropped_samples"] == a["rollout/aborted_samples"]

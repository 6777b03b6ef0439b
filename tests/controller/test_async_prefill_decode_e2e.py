"""Fully asynchronous training (`cluster.fully_async`) under prefill-decode disaggregation
(`rollout.prefill_replicas: 1` of 3 engine replicas), end to end on Ray: the producer's waves go
to the two decode replicas, each prefilled on the prefill replica first
(`async_producer/disaggregated.py`).

* max_staleness 0 is the synchronous PD run (`sync_and_zero_staleness_runs`: every metrics key
  but the timings equal, float64), whose transfer keys it has (> 0); and, as that run is, the
  synchronous run without PD (the two decode replicas serving alone): every key but timings,
  floats within 1e-12 (`test_prefill_decode_e2e`).
* max_staleness 1: the engines run ahead within the bound (groups continued over updates: their
  prompt + tokens prefilled again), every drawn prompt trained, dropped or held exactly once.
  A group is held open over every update and continued first after it
  (`held_open_train.held_open(continued_first=True)`), so that a continued group is trained
  whatever the engines' speed relative to the trainer's.
* `partial: in_place`, max_staleness 1: updates land in place on both sides (running requests
  keep their K/V on the decode replicas, counted), within the bound, the accounting exact.
* The prefill replica killed mid-run: it is replaced, the run completes, every drawn prompt
  trained, dropped or held exactly once.
"""

from __future__ import annotations

import re
import threading
from pathlib import Path

import pytest
import ray
from held_open_train import AHEAD_BY_ONE, assert_ran_ahead_by_one, held_open
from test_async_e2e import (
    ASYNC,
    LONG,
    PROMPTS,
    check_accounting,
    run_in_process,
    sync_and_zero_staleness_runs,
)
from test_async_engine_death_e2e import kill_after_rows
from test_fault_tolerance_e2e import in_background
from test_prefill_decode_e2e import PD_KEYS, differs
from test_resume_e2e import is_timing

pytestmark = pytest.mark.slow

ONE_PREFILL_TWO_DECODE = (
    "cluster.devices=4",
    "cluster.rollout_devices=3",
    "rollout.prefill_replicas=1",
)
TWO_REPLICAS = ("cluster.devices=3", "cluster.rollout_devices=2")


def pd_run(out: Path, *overrides: str) -> list[dict]:
    return run_in_process(out, *ONE_PREFILL_TWO_DECODE, *overrides)


TRANSFERS = ("rollout/pd_transfer_bytes", "rollout/pd_transfer_s")


def has_transfers(row: dict) -> bool:
    """The row has the PD keys, handoffs moved, none prefilled on its decode replica (single
    turns: every prompt through the prefill replica)."""
    return (
        PD_KEYS <= set(row)
        and all(row[k] > 0 for k in TRANSFERS)
        and row["rollout/pd_local_prefills"] == 0
    )


def transfers_where_prefilled(rows: list[dict]) -> None:
    """Some step's window moved handoffs, and every row with the transfer keys has them > 0
    (running ahead, a window may prefill nothing: the batch was generated before it)."""
    assert any(has_transfers(r) for r in rows)
    assert all(has_transfers(r) for r in rows if PD_KEYS & set(r))


def test_zero_staleness_pd_is_the_synchronous_pd_run(ray_four, cache, tmp_path):
    sync_pd, async_pd = sync_and_zero_staleness_runs(pd_run, tmp_path)
    assert all(has_transfers(s) and has_transfers(a) for s, a in zip(sync_pd, async_pd))
    plain = run_in_process(
        tmp_path / "plain",
        *TWO_REPLICAS,
        "steps=3",
        "checkpoint.every_steps=0",
        "rollout.max_new_tokens=8",
        "reward.function=user_rewards:length_score",
    )
    # as the synchronous PD run is the plain one: the fill's waves prefilled in one call, so
    # the same hit rates; that call's forward is larger than each plain replica's, so float64
    # log-probs (and what is computed from them) may differ in their last bits
    for s, a in zip(plain, async_pd, strict=True):
        same = [k for k in sorted(s) if not is_timing(k)]
        diff = {k: (s[k], a.get(k)) for k in same if differs(s[k], a.get(k), 1e-12)}
        assert not diff, f"step {s['step']}: {diff}"


def test_one_step_staleness_pd_runs_ahead_within_the_bound(ray_four, cache, tmp_path):
    # at every update one group is open with a token of the weights it replaces, and continued
    # first after it; with the default buffer (its room taken from the batches') the batch
    # taken after the update holds that group (`held_open_train.py`). An engine faster than the
    # trainer would otherwise leave no group open at an update
    with held_open(continued_first=True):
        rows = pd_run(
            tmp_path / "async1",
            "steps=4",
            "checkpoint.every_steps=0",
            *LONG,
            *ASYNC,
            *AHEAD_BY_ONE,
        )
    assert_ran_ahead_by_one(rows)
    transfers_where_prefilled(rows)
    assert len(check_accounting(rows)) == 4 * PROMPTS


def test_in_place_updates_pd_within_the_bound(ray_four, cache, tmp_path):
    rows = pd_run(
        tmp_path / "in_place",
        "steps=4",
        "checkpoint.every_steps=0",
        *LONG,
        *ASYNC,
        "rollout.partial=in_place",
        "cluster.max_staleness=1",
    )
    assert all(r["rollout/staleness_max"] <= 1 for r in rows)
    assert sum(r["rollout/in_place_reused_tokens"] for r in rows) > 0
    transfers_where_prefilled(rows)
    assert len(check_accounting(rows)) == 4 * PROMPTS


def test_a_killed_prefill_replica_is_replaced_and_nothing_is_lost(
    ray_four, cache, tmp_path, capsys
):
    out, known, done = tmp_path / "run", set(ray.util.list_named_actors()), threading.Event()
    thread, killer = in_background(lambda: kill_after_rows(out, ".engine.0", known, 2, done))
    try:
        rows = pd_run(
            out, "steps=4", "checkpoint.every_steps=0", *LONG, *ASYNC, "cluster.max_staleness=1"
        )
    finally:
        done.set()
        thread.join(timeout=30)
    assert "error" not in killer, killer
    printed = capsys.readouterr().out
    assert re.search(r"engine 0 died \(during \w+\): killed by ray\.kill; replaced it", printed)
    assert [r["step"] for r in rows] == list(range(4))
    assert sum(r["rollout/engine_restarts"] for r in rows) == 1
    assert all(r["rollout/staleness_max"] <= 1 for r in rows)
    assert len(check_accounting(rows)) == 4 * PROMPTS
    transfers_where_prefilled(rows)

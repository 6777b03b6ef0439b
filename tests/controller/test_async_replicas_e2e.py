"""Fully asynchronous training (`cluster.fully_async`) over two engine replicas, end to end on
Ray: 3 CPU slots, one trainer rank and two engines (`cluster.rollout_devices=2`).

* max_staleness 0 is the synchronous disaggregated run with the same two replicas: both loops
  give replica i the i-th contiguous share of a step's prompts, in data order, with the seeds
  of their data positions (`rollouts.shares.split`), so every metrics.jsonl key but the
  timings is equal (float64). The updates reach both replicas: a replica left with old weights
  would sample other tokens than the synchronous run's.
* max_staleness 1 on long responses, replica 1 killed mid-run: in every step before the
  death both replicas compute (`perf/engine_busy_frac_min`, the least busy replica's share of
  the step, is above 0; after it the replacement's share may finish early); no group is
  staler than the bound; the dead replica is replaced once and every drawn prompt is
  trained, dropped or held exactly once.
"""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import ray
from test_async_e2e import (
    ASYNC,
    BASE,
    LONG,
    PROMPTS,
    check_accounting,
    sync_and_zero_staleness_runs,
)
from test_async_engine_death_e2e import kill_after_rows
from test_fault_tolerance_e2e import in_background
from test_resume_e2e import RECIPE, rows_of

from miles_like.recipe.cli import main
from miles_like.run.loop import run

pytestmark = pytest.mark.slow

TWO_REPLICAS = ("cluster.devices=3", "cluster.rollout_devices=2")


def run_in_process(out: Path, *overrides: str) -> list[dict]:
    args = [RECIPE, f"tracking.output_dir={out}", *BASE, *TWO_REPLICAS, *overrides]
    assert main(args, run=run) == 0
    return rows_of(out)


def test_zero_staleness_is_the_synchronous_run_on_two_replicas(ray_four, cache, tmp_path):
    sync, asynchronous = sync_and_zero_staleness_runs(run_in_process, tmp_path)
    for s, a in zip(sync, asynchronous):
        assert a["rollout/trained_prompt_versions"] == [s["step"]] * PROMPTS


def test_both_replicas_generate_and_a_dead_one_is_replaced(ray_four, cache, tmp_path):
    out, known, done = tmp_path / "async1", set(ray.util.list_named_actors()), threading.Event()
    thread, killed = in_background(lambda: kill_after_rows(out, ".engine.1", known, 2, done))
    try:
        rows = run_in_process(
            out, "steps=5", "checkpoint.every_steps=0", *LONG, *ASYNC, "cluster.max_staleness=1"
        )
    finally:
        done.set()
        thread.join(timeout=30)
    assert "error" not in killed, killed
    assert [r["step"] for r in rows] == list(range(5))
    assert [r["rollout/engine_restarts"] for r in rows].count(1) == 1
    assert sum(r["rollout/engine_restarts"] for r in rows) == 1
    # both replicas compute in every step before the death; after it, the replacement's share
    # may have finished early (groups are not moved between replicas once sent), so a step
    # there can see one replica idle: the completed run and the accounting show it took part
    restart = [r["rollout/engine_restarts"] for r in rows].index(1)
    assert restart >= 1
    for r in rows[:restart]:
        assert r["perf/engine_busy_frac_min"] > 0, r
    assert all(r["rollout/staleness_max"] <= 1 for r in rows)
    assert any(r["rollout/staleness_max"] == 1 for r in rows[1:])
    assert len(check_accounting(rows)) == 5 * PROMPTS

"""Fully asynchronous training (`cluster.fully_async`, `async_loop.py`), end to end on Ray.

* max_staleness 0 is the synchronous disaggregated run (`off_policy_steps: 0`): every
  metrics.jsonl key of the synchronous rows but the timings is equal (float64), and the async
  rows add staleness 0, nothing dropped, each step training the next prompts_per_step prompts.
* max_staleness 1 on responses of varied lengths: the engines run ahead (the trainer's batches
  hold groups sampled partly by the previous weights, continued over updates: a group is held
  open over every update, `held_open_train.held_open(continued_first=True)`, so this holds
  whatever the engines' speed), no group is staler than the bound, and every drawn prompt is
  trained, dropped or held exactly once.
* Kill -9 at an arbitrary moment of an async run, resume with checkpoint.resume=auto: the rows
  of the finished run account for every drawn prompt exactly once (none trained twice, none
  lost), and groups open at the checkpoint with tokens were continued after the resume.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from held_open_train import AHEAD_BY_ONE, assert_ran_ahead_by_one, held_open
from killed_run import killed_run
from test_resume_e2e import RECIPE, is_timing, rows_of

from miles_like.recipe.cli import main
from miles_like.run import checkpoint
from miles_like.run.loop import run

pytestmark = pytest.mark.slow

PROMPTS = 4
BASE = (
    "rollout.prompts_per_step=4",
    "rollout.n=2",
    "rollout.kv_cache_tokens=4096",
    "rollout.temperature=0.8",
    "sft.steps=10",
    "sft.batch_size=16",
    "sft.cache=false",
    "trainer.lr=3e-3",
    "tracking.wandb_project=null",
    "cluster.devices=2",
    "cluster.colocate=false",
    "cluster.cpu_threads=1",
)
ASYNC = ("cluster.fully_async=true",)


def run_in_process(out: Path, *overrides: str) -> list[dict]:
    assert main([RECIPE, f"tracking.output_dir={out}", *BASE, *overrides], run=run) == 0
    return rows_of(out)


def check_accounting(rows: list[dict]) -> list[int]:
    """Every drawn prompt index is trained, dropped (stale, aborted, filtered) or held after the
    last step, once; returns the trained ones."""
    trained = [i for r in rows for i in r["rollout/trained_prompt_ids"]]
    dropped = [  # stale, aborted, or (dynamic sampling) filtered: rewards all equal
        i
        for r in rows
        for i in r["rollout/stale_dropped_prompt_ids"]
        + r["rollout/aborted_prompt_ids"]
        + r.get("rollout/dynamic_filtered_prompt_ids", [])
    ]
    held = rows[-1]["rollout/held_prompt_ids"]
    every = trained + dropped + held
    assert len(every) == len(set(every)), "a prompt was trained / dropped twice"
    assert sorted(every) == list(range(rows[-1]["rollout/data_consumed"]))
    for r in rows:
        assert len(r["rollout/trained_prompt_ids"]) == PROMPTS
        assert r["rollout/stale_dropped_groups"] == len(r["rollout/stale_dropped_prompt_ids"])
    assert rows[0]["rollout/taken_ahead"] == 0  # no step trained before the first
    return trained


def killed_and_resumed(
    out: Path, overrides: tuple[str, ...], every: int, module: str = "miles_like.train"
) -> list[dict]:
    """Runs `overrides` (with `steps=` and `checkpoint.every_steps=every`) in a subprocess
    (`python -m module`), SIGKILLs it 0.3 s after its first checkpoint (inside a step, not at a
    checkpoint), resumes it in this process with checkpoint.resume=auto, and returns the
    finished run's rows: every step once, and every drawn prompt trained, dropped or held
    exactly once."""
    steps = next(int(o.split("=")[1]) for o in overrides if o.startswith("steps="))
    marker = out / "checkpoints" / f"step_{every:06d}" / "state.json"
    args = [RECIPE, *BASE, *overrides]
    with killed_run(out, args, marker, delay_s=0.3, module=module) as kill:
        pass  # the run goes on alone until the watcher kills it
    assert kill.rows_at_kill and every <= kill.rows_at_kill[0] < steps, "not killed mid-run"
    rows = run_in_process(out, *overrides, "checkpoint.resume=auto")
    assert [r["step"] for r in rows] == list(range(steps))
    assert len(check_accounting(rows)) == steps * PROMPTS
    return rows


def sync_and_zero_staleness_runs(runner, tmp_path: Path) -> tuple[list[dict], list[dict]]:
    """3 steps synchronous and fully async at max_staleness 0 (`runner`: a `run_in_process`),
    asserted equal on every metrics key but timings, and the runs really learning (lengths
    vary, updates are real). Returns (sync rows, async rows)."""
    common = (
        "steps=3",
        "checkpoint.every_steps=0",
        "rollout.max_new_tokens=8",
        "reward.function=user_rewards:length_score",
    )
    sync = runner(tmp_path / "sync", *common)
    asynchronous = runner(tmp_path / "async", *common, *ASYNC, "cluster.max_staleness=0")
    assert len(sync) == len(asynchronous) == 3
    for s, a in zip(sync, asynchronous):
        diff = {k: (s[k], a.get(k)) for k in sorted(s) if not is_timing(k) and s[k] != a.get(k)}
        assert not diff, f"step {s['step']}: {diff}"
        assert a["rollout/staleness_max"] == 0 and a["rollout/stale_dropped_groups"] == 0
        assert a["rollout/taken_ahead"] == 0  # the next batch is generated after the update
    assert len({r["rollout/response_len_mean"] for r in sync}) > 1
    assert all(r["train/grad_norm"] > 0 for r in sync)
    check_accounting(asynchronous)
    return sync, asynchronous


def test_zero_staleness_is_the_synchronous_run(ray_local, cache, tmp_path):
    sync, asynchronous = sync_and_zero_staleness_runs(run_in_process, tmp_path)
    for s, a in zip(sync, asynchronous):
        assert a["rollout/trained_prompt_ids"] == list(
            range(s["step"] * PROMPTS, (s["step"] + 1) * PROMPTS)
        )
        assert a["rollout/continued_groups"] == 0


# long responses (a length reward, room to run): generating a batch outlasts training one, so
# requests are running at each weight update and are continued across it
LONG = (
    "rollout.max_new_tokens=160",
    "reward.function=user_rewards:length_score",
)


def test_one_step_staleness_runs_ahead_within_the_bound(ray_local, cache, tmp_path):
    # at every update one group is open with a token of the weights it replaces, and continued
    # first after it; with the default buffer (its room taken from the batches') the batch
    # taken after the update holds that group (`held_open_train.py`). An engine faster than the
    # trainer would otherwise leave no group open at an update
    with held_open(continued_first=True):
        rows = run_in_process(
            tmp_path / "async1",
            "steps=5",
            "checkpoint.every_steps=0",
            *LONG,
            *ASYNC,
            *AHEAD_BY_ONE,
        )
    # the engines generated while the trainer trained: later batches hold groups (partly)
    # sampled by the previous weights, some of them continued over a weight update
    assert_ran_ahead_by_one(rows)
    trained = check_accounting(rows)
    assert len(trained) == 5 * PROMPTS


STEPS = 12


def test_killed_async_run_resumes_without_loss_or_repeat(ray_local, cache, tmp_path):
    out = tmp_path / "killed"
    overrides = (
        f"steps={STEPS}",
        "checkpoint.every_steps=3",
        "checkpoint.keep_last=100",
        *LONG,
        *ASYNC,
        "cluster.max_staleness=1",
        # the default capacity (prompts_per_step x (max_staleness + 1)), and a room for the group
        # the killed run keeps back for each update (`held_open_train.py`)
        f"cluster.async_buffer_groups={2 * PROMPTS + 1}",
    )
    # nothing lost, nothing twice (`killed_and_resumed`); the groups open or buffered at the
    # checkpoint resumed from are among them (after it). The killed run holds a group open with
    # tokens at every update (an engine faster than the trainer leaves none open by itself)
    rows = killed_and_resumed(out, overrides, every=3, module="held_open_train")
    # a checkpoint's state holds every untrained group: the step before one takes no batch
    # ahead (checkpoints after steps 2, 5, 8; the resumed run starts at one)
    assert all(r["rollout/taken_ahead"] == 0 for r in rows if r["step"] % 3 == 0)
    # the checkpoints hold open groups with their partial tokens, log-probs and versions
    # (every checkpoint is kept: the killed run's and the resumed run's)
    partial = [
        g
        for c in checkpoint.complete_checkpoints(out)
        for g in json.loads((c / "state.json").read_text())["async"]["open"]
        if any(s["token_ids"] for s in g["samples"])
    ]
    assert partial
    assert all(
        len(s["token_ids"]) == len(s["logprobs"]) == len(s["versions"])
        for g in partial
        for s in g["samples"]
    )
    assert sum(r["rollout/continued_groups"] for r in rows) > 0

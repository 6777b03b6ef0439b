"""An engine that dies in fully asynchronous training (`cluster.fully_async`), end to end on
Ray: it is replaced (`async_producer.replacement.Replicas.replace_dead`) and the run goes on, within
`cluster.max_engine_restarts`.

The engine actor is killed with `ray.kill` from a thread of this process, while `miles_like.
train` runs in it, right after a step's row is logged: async, the engine is generating then
(it generates through every phase).

* Replaced once: the run completes; every drawn prompt is trained, dropped or held exactly once
  (the dead engine's open groups went on from the tokens they had delivered);
  `rollout/engine_restarts` sums to 1; every group drawn after the replacement was sampled at
  or above the weight version it was replaced at (the new engine carries the version of the
  weights it took), and such groups were trained.
* A death past the budget (`cluster.max_engine_restarts=1`, a second kill, of the replacement)
  stops the run with one line naming the field, exit code 1.
"""

from __future__ import annotations

import re
import threading
import time
from pathlib import Path

import pytest
import ray
from test_async_e2e import ASYNC, BASE, LONG, check_accounting
from test_fault_tolerance_e2e import in_background, new_actor
from test_resume_e2e import RECIPE, rows_of

from miles_like.recipe.cli import main
from miles_like.run.loop import run

pytestmark = pytest.mark.slow

REPLACED = re.compile(
    r"engine 0 died \(during \w+\): killed by ray\.kill; replaced it at weight version "
    r"(\d+): the \d+ open groups waiting continue from the tokens they had "
    r"\((\d+) prompts drawn\)"
)


def kill_after_rows(out: Path, suffix: str, known: set[str], rows: int, done: threading.Event):
    """Kill the run's first actor named *`suffix` as soon as metrics.jsonl has `rows` rows."""
    engine = new_actor(suffix, known)
    metrics = out / "metrics.jsonl"
    while not done.is_set():
        if metrics.exists() and len(metrics.read_text().splitlines()) >= rows:
            ray.kill(engine)
            return
        time.sleep(0.005)


def async_run(out: Path, killer, *overrides: str) -> int:
    done = threading.Event()
    thread, killed = in_background(lambda: killer(done))
    try:
        return main(
            [
                RECIPE,
                f"tracking.output_dir={out}",
                *BASE,
                *LONG,
                *ASYNC,
                "cluster.max_staleness=1",
                "checkpoint.every_steps=0",
                *overrides,
            ],
            run=run,
        )
    finally:
        done.set()
        thread.join(timeout=30)
        assert "error" not in killed, killed


def test_a_dead_engine_is_replaced_and_nothing_is_lost(ray_local, cache, tmp_path, capsys):
    out, known = tmp_path / "run", set(ray.util.list_named_actors())
    code = async_run(out, lambda done: kill_after_rows(out, ".engine.0", known, 2, done), "steps=6")
    printed = capsys.readouterr().out
    assert code == 0, printed[-3000:]
    (match,) = REPLACED.findall(printed)
    version, drawn = int(match[0]), int(match[1])
    rows = rows_of(out)
    assert [r["step"] for r in rows] == list(range(6))
    assert sum(r["rollout/engine_restarts"] for r in rows) == 1
    assert rows[0]["rollout/engine_restarts"] == rows[1]["rollout/engine_restarts"] == 0
    trained = check_accounting(rows)
    assert len(trained) == 6 * 4
    assert all(r["rollout/staleness_max"] <= 1 for r in rows)
    # groups drawn after the replacement: sampled by the new engine (or later weights) only
    after = [
        v
        for r in rows
        for i, v in zip(r["rollout/trained_prompt_ids"], r["rollout/trained_prompt_versions"])
        if i >= drawn
    ]
    assert after and min(after) >= version >= 2, (version, drawn, after)


def test_a_death_past_the_budget_stops_the_run(ray_local, cache, tmp_path, capsys):
    out, known = tmp_path / "run", set(ray.util.list_named_actors())

    def kill_twice(done: threading.Event) -> None:
        kill_after_rows(out, ".engine.0", known, 2, done)
        kill_after_rows(out, ".engine.0.restart1", known, 3, done)

    code = async_run(out, kill_twice, "steps=8", "cluster.max_engine_restarts=1")
    captured = capsys.readouterr()
    assert code == 1, captured.out[-3000:]
    assert len(REPLACED.findall(captured.out)) == 1
    assert "Traceback" not in captured.err
    last = captured.err.splitlines()[-1]
    assert re.fullmatch(
        r"error: engine 0 died \(during \w+\): killed by ray\.kill; "
        r"cluster\.max_engine_restarts=1 replacements made already in this run; raise it, "
        r"or resume with checkpoint\.resume=auto",
        last,
    ), last
    assert len(rows_of(out)) >= 3

"""Checkpoint bookkeeping without a run: which directories count as complete, how
`checkpoint.resume` resolves and fails, the commit / keep-last rotation, and how metrics.jsonl
is rebuilt on resume. (Exactness of a resumed run: test_resume_e2e.py.)"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from miles_like.recipe import RecipeError, load_recipe
from miles_like.recipe.cli import main
from miles_like.run import checkpoint
from miles_like.run.tracking import REQUIRED_KEYS, Tracker

ROOT = Path(__file__).resolve().parents[2]
RECIPE = str(ROOT / "recipes" / "tiny_arith_grpo.yaml")


def make_checkpoint(out: Path, step: int, complete: bool = True) -> Path:
    d = checkpoint.checkpoints_dir(out) / f"step_{step:06d}"
    d.mkdir(parents=True)
    (d / "model.safetensors").write_bytes(b"")
    if complete:
        (d / checkpoint.STATE_FILE).write_text(json.dumps({"format": checkpoint.FORMAT}))
    return d


def recipe(out: Path, resume) -> object:
    return load_recipe(RECIPE, [f"tracking.output_dir={out}", f"checkpoint.resume={resume}"])


def test_auto_takes_the_latest_complete_checkpoint(tmp_path):
    make_checkpoint(tmp_path, 2)
    make_checkpoint(tmp_path, 10)  # numeric order, not only by name
    make_checkpoint(tmp_path, 12, complete=False)  # no state.json: interrupted or old format
    tmp = checkpoint.begin(tmp_path, 13)  # an interrupted write
    assert tmp.name == ".tmp-step_000013"
    lines = []
    got = checkpoint.resolve_resume(recipe(tmp_path, "auto"), log=lines.append)
    assert got == checkpoint.checkpoints_dir(tmp_path) / "step_000010"
    assert lines == [f"resume: continuing from {got}"]


def test_auto_without_a_complete_checkpoint_starts_fresh(tmp_path):
    make_checkpoint(tmp_path, 4, complete=False)
    lines = []
    assert checkpoint.resolve_resume(recipe(tmp_path, "auto"), log=lines.append) is None
    assert len(lines) == 1 and "starting fresh" in lines[0]
    assert checkpoint.resolve_resume(recipe(tmp_path, "false"), log=lines.append) is None


def test_resume_path_errors_are_one_line_naming_the_field(tmp_path, capsys):
    incomplete = make_checkpoint(tmp_path, 3, complete=False)
    a_file = tmp_path / "file.txt"
    a_file.write_text("")
    for bad in (tmp_path / "missing", incomplete, a_file):
        with pytest.raises(RecipeError) as e:
            recipe(tmp_path, bad)
        message = str(e.value)
        assert "\n" not in message and message.startswith(f"checkpoint.resume={str(bad)!r}")
        assert main([RECIPE, f"checkpoint.resume={bad}"], run=lambda r: 0) == 2
        err = capsys.readouterr().err.strip()
        assert "\n" not in err and "checkpoint.resume" in err
    good = make_checkpoint(tmp_path, 4)
    assert checkpoint.resolve_resume(recipe(tmp_path, good), log=lambda _: None) == good


@pytest.mark.parametrize("value,words", [("true", "false | auto | str"), ("''", "empty")])
def test_resume_values_other_than_false_auto_or_a_path_are_refused(tmp_path, value, words):
    with pytest.raises(RecipeError, match="checkpoint.resume") as e:
        recipe(tmp_path, value)
    assert words in str(e.value)


def test_a_fresh_run_refuses_an_output_dir_with_checkpoints(tmp_path):
    checkpoint.refuse_earlier_run(tmp_path)  # nothing there: fine
    make_checkpoint(tmp_path, 5, complete=False)
    checkpoint.refuse_earlier_run(tmp_path)  # incomplete ones do not count
    make_checkpoint(tmp_path, 6)
    with pytest.raises(RecipeError, match="checkpoint.resume: auto"):
        checkpoint.refuse_earlier_run(tmp_path)


def test_commit_marks_complete_last_and_keeps_the_newest(tmp_path):
    # a deletion a killed run left unfinished: renamed away first, so never taken as complete
    (checkpoint.checkpoints_dir(tmp_path) / ".del-step_000000").mkdir(parents=True)
    for step in (1, 2, 3):
        tmp = checkpoint.begin(tmp_path, step)
        (tmp / "model.safetensors").write_bytes(b"w")
        assert f"step_{step:06d}" not in [p.name for p in checkpoint.complete_checkpoints(tmp_path)]
        final = checkpoint.commit(tmp, {"next_step": step}, keep_last=2)
        assert final.name == f"step_{step:06d}" and not tmp.exists()
        assert checkpoint.read_state(final) == {"format": checkpoint.FORMAT, "next_step": step}
    assert sorted(p.name for p in checkpoint.checkpoints_dir(tmp_path).iterdir()) == [
        "step_000002",
        "step_000003",
    ]


def row(step: int, value: float) -> dict:
    return {**{k: 0.0 for k in REQUIRED_KEYS}, "step": step, "rollout/reward_mean": value}


def test_resumed_tracker_drops_rows_written_after_the_checkpoint(tmp_path):
    first = Tracker(tmp_path, {}, print_fn=lambda _: None)
    for step in range(5):  # a killed run got to step 4; its checkpoint is before step 3
        first.log(row(step, float(step)))
    first._file.close()
    resumed = Tracker(tmp_path, {}, print_fn=lambda _: None, resume_step=3, last_row=row(2, 2.0))
    resumed.log(row(3, 30.0))
    resumed.finish()
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["rollout/reward_mean"]) for r in rows] == [
        (0, 0.0),
        (1, 1.0),
        (2, 2.0),
        (3, 30.0),
    ]


def test_resumed_tracker_restores_the_checkpoints_row_if_the_run_died_before_logging_it(tmp_path):
    first = Tracker(tmp_path, {}, print_fn=lambda _: None)
    for step in range(2):
        first.log(row(step, float(step)))
    first._file.close()
    resumed = Tracker(tmp_path, {}, print_fn=lambda _: None, resume_step=3, last_row=row(2, 2.0))
    resumed.finish()
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2]

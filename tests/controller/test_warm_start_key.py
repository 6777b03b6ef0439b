"""The warm-start cache key includes the code the SFT checkpoint depends on: a changed trainer
or task never reuses an old checkpoint."""

from __future__ import annotations

from pathlib import Path

from miles_like.recipe import load_recipe
from miles_like.run import warm_start

ROOT = Path(__file__).resolve().parents[2]


def test_the_key_covers_the_trainer_the_task_and_the_batches():
    names = {f.relative_to(ROOT).as_posix() for f in warm_start.code_files()}
    assert {
        "trainer/objective.py",
        "trainer/losses.py",
        "trainer/optim.py",
        "miles_like/run/warm_start.py",
        "miles_like/data.py",
        "miles_like/tasks/arith.py",
        "miles_like/models/tokenizer.py",
        "model_spec/rope.py",
        "model_spec/spec.py",
        "miles_like/rollouts/tool_schema.py",
    } <= names


def test_a_changed_source_file_changes_the_key(tmp_path, monkeypatch):
    recipe = load_recipe(ROOT / "recipes" / "tiny_arith_grpo.yaml")
    base = tmp_path / "base"
    base.mkdir()
    source = tmp_path / "objective.py"
    monkeypatch.setattr(warm_start, "code_files", lambda: [source])

    def key(text: str) -> list:
        source.write_text(text)
        return warm_start._identity(recipe, base)

    first = key("loss = pg / tokens\n")
    assert key("loss = pg / tokens\n") == first  # stable
    assert key("loss = pg / sequences\n") != first  # a code change is a new key
    monkeypatch.undo()
    assert warm_start._identity(recipe, base) == warm_start._identity(recipe, base)

"""The command line: --help from the dataclasses, --dry-run, one-line errors with exit code 2,
the hook a run is handed to, and the field table of docs/recipes.md, generated."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from config_schema import describe
from miles_like.recipe import Recipe, RecipeError, load_recipe
from miles_like.recipe.cli import EXIT_USER_ERROR, main

REPO = Path(__file__).resolve().parents[2]
MINIMAL = "model:\n  builtin: tiny-qwen2\ndata:\n  synthetic: arith\n"


@pytest.fixture
def recipe_file(tmp_path):
    path = tmp_path / "r.yaml"
    path.write_text(MINIMAL)
    return path


def test_dry_run_prints_the_resolved_recipe(recipe_file, capsys, tmp_path):
    assert main([str(recipe_file), "rollout.n=4", "trainer.lr=1e-5", "--dry-run"]) == 0
    out = capsys.readouterr().out
    data = yaml.safe_load(out)
    assert data["rollout"]["n"] == 4 and data["trainer"]["lr"] == 1e-5
    resolved = tmp_path / "resolved.yaml"
    resolved.write_text(out)
    assert load_recipe(resolved) == load_recipe(recipe_file, ["rollout.n=4", "trainer.lr=1e-5"])


def test_error_is_one_line_on_stderr_with_exit_2(recipe_file, capsys):
    assert main([str(recipe_file), "rollout.temprature=0.5", "--dry-run"]) == EXIT_USER_ERROR
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.strip().splitlines()
    assert (
        len(lines) == 1 and "rollout.temprature" in lines[0] and "rollout.temperature" in lines[0]
    )


def test_missing_recipe_file(tmp_path, capsys):
    assert main([str(tmp_path / "none.yaml"), "--dry-run"]) == EXIT_USER_ERROR
    assert "no such file" in capsys.readouterr().err


def test_an_error_found_while_starting_the_run_is_one_line(recipe_file, capsys):
    def run(recipe):
        raise RecipeError("data.prompt_key='q': the file has no such column; its columns are a, b")

    assert main([str(recipe_file)], run=run) == EXIT_USER_ERROR
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: data.prompt_key='q'")


def test_run_hook_receives_the_recipe(recipe_file):
    seen = []
    assert main([str(recipe_file), "steps=3"], run=lambda r: seen.append(r) or 0) == 0
    assert isinstance(seen[0], Recipe) and seen[0].steps == 3


def test_no_path_check(tmp_path, capsys):
    path = tmp_path / "r.yaml"
    path.write_text(MINIMAL.replace("builtin: tiny-qwen2", "path: /not/here"))
    assert main([str(path), "--dry-run"]) == EXIT_USER_ERROR
    assert "model.path" in capsys.readouterr().err
    assert main([str(path), "--dry-run", "--no-path-check"]) == 0


def test_help_lists_every_field_with_default_and_doc(capsys):
    with pytest.raises(SystemExit) as info:
        main(["--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    rows = describe(Recipe)
    assert len(rows) > 60
    for name, type_text, default, _doc in rows:
        assert f"  {name}  ({type_text}; default {default})" in out
    assert "samples per prompt (the group size)" in out
    assert "grpo | dr_grpo | rloo | reinforce_pp | gae" in out
    # every section of the recipe is there
    for f in dataclasses.fields(Recipe):
        assert any(name == f.name or name.startswith(f.name + ".") for name, *_ in rows)


def test_module_entry_point_no_traceback(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text(MINIMAL + "rollout:\n  n: many\n")
    proc = subprocess.run(
        [sys.executable, "-m", "miles_like.train", str(bad), "--dry-run"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert proc.stderr.strip().count("\n") == 0 and "rollout.n" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_docs_list_every_recipe_field_as_generated():
    from miles_like.recipe.cli import fields_markdown

    page = (REPO / "docs" / "recipes.md").read_text()
    start = page.index("<!-- recipe-fields:start")
    body = page[page.index("\n", start) + 1 : page.index("<!-- recipe-fields:end -->")]
    assert body.strip() == fields_markdown().strip(), (
        "docs/recipes.md's field table is stale: run python scripts/render_recipe_fields.py"
    )


def test_the_entry_module_imports_nothing_heavy():
    """A run's reward and tool workers are spawned: each imports `python -m miles_like.train`'s
    module again as its `__main__` before it starts. Imported as a spawned worker imports it
    (a fresh interpreter), it must not pull in torch (seconds of CPU in each of the workers)."""
    code = "import sys, miles_like.train; print(sorted({'torch', 'ray'} & set(sys.modules)))"
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"


def test_a_deprecated_field_prints_one_warning_line(recipe_file, capsys):
    assert main([str(recipe_file), "algorithm.gspo=true", "--dry-run"]) == 0
    captured = capsys.readouterr()
    assert yaml.safe_load(captured.out)["algorithm"]["policy_loss"] == "gspo"
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("warning: algorithm.gspo is deprecated; write")

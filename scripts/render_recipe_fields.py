"""Rewrite the table of every recipe field in docs/recipes.md from the recipe's dataclasses
(`miles_like.recipe.cli.fields_markdown`); tests/controller/test_cli.py fails when it is stale.

    python scripts/render_recipe_fields.py
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from miles_like.recipe.cli import fields_markdown  # noqa: E402

PAGE = ROOT / "docs" / "recipes.md"
START, END = "<!-- recipe-fields:start", "<!-- recipe-fields:end -->"


def main() -> None:
    text = PAGE.read_text()
    head = text[: text.index("\n", text.index(START)) + 1]
    tail = text[text.index(END) :]
    PAGE.write_text(head + fields_markdown().strip() + "\n" + tail)


if __name__ == "__main__":
    main()

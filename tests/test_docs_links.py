"""The front page and the docs point at things that exist: every relative Markdown link names a
file of the repository (and, with `#anchor`, one of its headings), and every repository path
written in backticks (`tests/controller/test_loop_e2e.py`, `benchmarks/run_record.py`, ...) is
a file or folder of the tree. A test or module that moves breaks this test, not the reader."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [
    ROOT / "README.md",
    ROOT / "benchmarks" / "RESULTS.md",
    *sorted((ROOT / "docs").glob("*.md")),
]
TOP = (
    "tests",
    "benchmarks",
    "recipes",
    "miles_like",
    "rollout",
    "trainer",
    "weight_sync",
    "model_spec",
    "native_build",
    "scripts",
)
LINK = re.compile(r"\]\(([^)\s]+)\)")
# a file (with its extension) or a folder (a trailing slash): `rollout/reward_mean` is a metric
CODE_PATH = re.compile(
    r"`((?:" + "|".join(TOP) + r")/(?:[\w./-]*\.\w+|[\w./-]*/))(?:::[\w\[\]-]+)?`"
)
FENCE = re.compile(r"^```.*?^```", re.S | re.M)


def anchor(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation but `-` and `_` dropped, spaces
    to `-`."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    text = FENCE.sub("", page.read_text())
    return {anchor(m.group(1)) for m in re.finditer(r"^#+ (.+)$", text, re.M)}


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page):
    for target in LINK.findall(FENCE.sub("", page.read_text())):
        if re.match(r"[a-z]+:", target):
            continue  # http(s), mailto
        path, _, frag = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        assert dest.exists(), f"{page.name}: link to {target}: no such file"
        if frag:
            assert frag in anchors(dest), f"{page.name}: link to {target}: no such heading"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_repository_paths_in_backticks_exist(page):
    for path in CODE_PATH.findall(page.read_text()):
        if "*" in path or "<" in path:
            continue
        assert (ROOT / path).exists(), f"{page.name}: `{path}` does not exist"

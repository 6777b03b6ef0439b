"""The command line: `python -m miles_like.train RECIPE.yaml [key=value ...] [--dry-run]`.

User errors (a bad recipe, a bad override, a missing file) print one line to stderr and exit
with code 2; a run stopped by a dead or hung actor prints one line (what failed, how to resume)
and exits with code 1; no traceback. A deprecated recipe field still accepted prints one
`warning:` line. `--help` lists every recipe field with its type, default and doc, generated
from the declarations in `sections.py`.
"""

from __future__ import annotations

import argparse
import sys
import textwrap
import warnings
from collections.abc import Callable, Sequence

from config_schema import describe
from miles_like.errors import RecipeError, RunFailed
from miles_like.recipe.load import load_recipe, recipe_to_yaml
from miles_like.recipe.recipe import Recipe
from miles_like.run.orphans import terminate_gracefully

EXIT_USER_ERROR = 2
EXIT_RUN_FAILED = 1
PROG = "python -m miles_like.train"


def fields_help(width: int = 100) -> str:
    """Every recipe field as `name (type, default ...)` plus its doc, grouped by section."""
    lines = [
        "recipe fields (YAML sections; override any as section.field=value; the model and",
        "data sections are required: set model.path or model.builtin, data.path or",
        "data.synthetic):",
    ]
    section = None
    for name, type_text, default, doc in describe(Recipe):
        head = name.split(".")[0] if "." in name else ""
        if head != section:
            section = head
            lines.append("")
            lines.append(f"{head}:" if head else "top level:")
        lines.append(f"  {name}  ({type_text}; default {default})")
        if doc:
            lines.extend(
                textwrap.wrap(doc, width=width, initial_indent="      ", subsequent_indent="      ")
            )
    return "\n".join(lines)


def fields_markdown() -> str:
    """Every recipe field as a Markdown table (docs/recipes.md embeds it; a test keeps them
    equal: `python scripts/render_recipe_fields.py` rewrites it)."""
    lines = ["| field | type | default | meaning |", "|---|---|---|---|"]
    for name, type_text, default, doc in describe(Recipe):
        cell = doc.replace("|", "\\|")
        lines.append(f"| `{name}` | {type_text.replace('|', '/')} | `{default}` | {cell} |")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="RL post-training from a YAML recipe. Values in overrides are YAML scalars "
        "(rollout.n=4, trainer.lr=1e-5, cluster.address=null).",
        epilog=fields_help(),
    )
    parser.add_argument("recipe", help="recipe YAML file, e.g. recipes/tiny_arith_grpo.yaml")
    parser.add_argument(
        "overrides",
        nargs="*",
        metavar="key=value",
        help="dotted overrides applied on top of the recipe",
    )
    parser.add_argument(
        "--dry-run", action="store_true", help="validate, print the resolved recipe as YAML, exit 0"
    )
    parser.add_argument(
        "--no-path-check",
        action="store_true",
        help="skip checks that need the local files (model.path, data.path, a "
        "user reward module): check a recipe meant for another machine",
    )
    return parser


def main(argv: Sequence[str] | None = None, run: Callable[[Recipe], int] | None = None) -> int:
    """Parse, load, validate; then print (dry run) or hand the recipe to `run`. Returns the exit
    code. `run` is the RL loop (`loop.run` unless a caller passes another)."""
    # intermixed: overrides may come before and after flags (RECIPE --dry-run rollout.n=4)
    args = build_parser().parse_intermixed_args(argv)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", FutureWarning)  # a deprecated field, every time
        try:
            recipe = load_recipe(
                args.recipe, args.overrides, check_paths_exist=not args.no_path_check
            )
        except RecipeError as e:
            recipe, error = None, e
    for w in caught:  # one line each, not the warnings module's file:line + source line
        print(f"warning: {' '.join(str(w.message).split())}", file=sys.stderr)
    if recipe is None:
        print(f"error: {error}", file=sys.stderr)
        return EXIT_USER_ERROR
    if args.dry_run:
        sys.stdout.write(recipe_to_yaml(recipe))
        return 0
    if run is None:
        from miles_like.run.loop import (
            run,  # imports Ray and torch: not needed for --help / --dry-run
        )
    try:
        with terminate_gracefully():  # SIGTERM cleans up as Ctrl-C does (`orphans`)
            return run(recipe)
    except RecipeError as e:  # found while starting the run (data columns, tokenizer, sizes)
        print(f"error: {e}", file=sys.stderr)
        return EXIT_USER_ERROR
    except RunFailed as e:  # an actor died or hung; the message says how to resume
        print(f"error: {e}", file=sys.stderr)
        return EXIT_RUN_FAILED

"""Old module paths of user-facing modules, kept importable for one release.

The controller was regrouped into sub-packages (`recipe/`, `run/`, `rollouts/`, `scoring/`,
`models/`); user code written against the flat layout (`from miles_like.rollout_context import
RolloutContext`, `rollout.function: miles_like.tool_loop:tool_loop`) still imports, with one
deprecation warning naming the new path."""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import warnings

MOVED = {
    "miles_like.rollout_context": "miles_like.rollouts.context",
    "miles_like.trajectory": "miles_like.rollouts.trajectory",
    "miles_like.single_turn": "miles_like.rollouts.single_turn",
    "miles_like.tool_loop": "miles_like.rollouts.tool_loop",
    "miles_like.tools": "miles_like.rollouts.tools",
    "miles_like.rewards": "miles_like.scoring.rewards",
    "miles_like.reward_shaping": "miles_like.scoring.shaping",
    "miles_like.tokenizer": "miles_like.models.tokenizer",
}


class _Alias(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds an old name and hands out the module of the new name (one module object)."""

    def find_spec(self, name, path=None, target=None):
        return importlib.util.spec_from_loader(name, self) if name in MOVED else None

    def create_module(self, spec):
        warnings.warn(
            f"{spec.name} moved to {MOVED[spec.name]}; import it from there (the old path goes "
            "in the next release)",
            DeprecationWarning,
            stacklevel=2,
        )
        module = importlib.import_module(MOVED[spec.name])
        return module

    def exec_module(self, module):
        # importing set the alias spec on the shared module object: give it its own back
        module.__spec__ = importlib.util.spec_from_file_location(module.__name__, module.__file__)


def install() -> None:
    if not any(isinstance(f, _Alias) for f in sys.meta_path):
        sys.meta_path.append(_Alias())

"""Every tensor storage an engine holds, found by walking its object graph: what a release must
free is checked by weak references to these storages (`StorageWeakRef`), independently of the
engine's own bookkeeping (a tensor forgotten in some cache is found wherever it hangs).

The walk follows attributes, containers, NamedTuples / dataclasses and `nn.Module`s of objects
defined in our packages, and collects every tensor it meets with the path that reached it.
"""

from __future__ import annotations

import gc

import torch
from torch.multiprocessing.reductions import StorageWeakRef

OUR_PACKAGES = ("rollout", "model_spec")


def _ours(obj) -> bool:
    module = type(obj).__module__ or ""
    return module.split(".")[0] in OUR_PACKAGES


def tensors_held(root) -> dict[str, torch.Tensor]:
    """path -> tensor, for every tensor reachable from `root` (one path each)."""
    found: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    stack: list[tuple[str, object]] = [("engine", root)]
    while stack:
        path, obj = stack.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            found[path] = obj
            continue
        if isinstance(obj, dict):
            stack += [(f"{path}[{k!r}]", v) for k, v in obj.items()]
        elif isinstance(obj, (list, tuple, set, frozenset)):
            stack += [(f"{path}[{i}]", v) for i, v in enumerate(obj)]
        elif isinstance(obj, torch.nn.Module) or _ours(obj):
            attrs = dict(vars(obj)) if hasattr(obj, "__dict__") else {}
            for name in getattr(type(obj), "__slots__", ()):
                if hasattr(obj, name):
                    attrs[name] = getattr(obj, name)
            if isinstance(obj, tuple):  # NamedTuple fields
                attrs.update(obj._asdict())
            stack += [(f"{path}.{k}", v) for k, v in attrs.items()]
    return found


def storages_held(root) -> dict[str, StorageWeakRef]:
    """path -> weak reference to the storage of every non-empty tensor reachable from `root`."""
    return {
        path: StorageWeakRef(t.untyped_storage())
        for path, t in tensors_held(root).items()
        if t.untyped_storage().nbytes() > 0
    }


def still_alive(refs: dict[str, StorageWeakRef]) -> list[str]:
    """The paths whose storage is still referenced by anything (after a full collection)."""
    gc.collect()
    return sorted(path for path, ref in refs.items() if not ref.expired())

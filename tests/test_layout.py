"""The package layout's rules (DESIGN.md, docs/architecture.md), checked on the source:

* the arrows between packages: `miles_like` may import the others; `rollout` and `trainer`
  never import each other; `weight_sync` imports none of them; the leaves `native_build`,
  `model_spec`, `config_schema`, `collectives` and `quantization` import nothing of ours;
* no import cycle between modules, counting imports inside functions (they hide cycles, they do
  not remove them);
* no module imports another module's `_private` name;
* no class in package code longer than `MAX_CLASS_LINES`, except those `docs/architecture.md`
  justifies by name in its "Large classes" section.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = (
    "miles_like",
    "rollout",
    "trainer",
    "weight_sync",
    "native_build",
    "model_spec",
    "config_schema",
    "collectives",
    "quantization",
)
MAY_IMPORT = {
    "miles_like": {
        "rollout",
        "trainer",
        "weight_sync",
        "native_build",
        "model_spec",
        "config_schema",
        "collectives",
        "quantization",
    },
    "rollout": {"native_build", "model_spec", "config_schema", "collectives", "quantization"},
    "trainer": {"native_build", "model_spec", "config_schema", "collectives"},
    "weight_sync": {"native_build", "collectives", "quantization"},
    "native_build": set(),
    "model_spec": set(),  # leaf: the config.json parser the engine and the trainer share
    "config_schema": set(),  # leaf: the validator every config is declared with
    "collectives": set(),  # leaf: every torch.distributed collective, on the group's device
    "quantization": set(),  # leaf: the FP8 format the weight sync and the engine share
}
MAX_CLASS_LINES = 300


def _modules() -> dict[str, Path]:
    out = {}
    for pkg in PACKAGES:
        for path in (ROOT / pkg).rglob("*.py"):
            parts = path.relative_to(ROOT).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            out[name] = path
    return out


MODULES = _modules()


def _resolve(name: str) -> str | None:
    """The module of ours `name` refers to (a module, or an attribute of one), or None."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def _imports(module: str, path: Path):
    """(imported module of ours, imported names, line) for every import statement, anywhere."""
    tree = ast.parse(path.read_text())
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                target = _resolve(alias.name)
                if target:
                    yield target, [], node.lineno
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(up + ([base] if base else []))
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                if sub in MODULES:  # `from pkg import module`
                    yield sub, [], node.lineno
                else:
                    target = _resolve(base)
                    if target:
                        yield target, [alias.name], node.lineno


GRAPH = {
    m: sorted({(t, tuple(n), line) for t, n, line in _imports(m, p) if t != m})
    for m, p in MODULES.items()
}


def test_package_arrows():
    wrong = [
        f"{m}:{line} imports {t}"
        for m, edges in GRAPH.items()
        for t, _, line in edges
        if t.split(".")[0] != m.split(".")[0] and t.split(".")[0] not in MAY_IMPORT[m.split(".")[0]]
    ]
    assert not wrong, "\n".join(wrong)


def test_no_import_cycles():
    edges = {m: {t for t, _, _ in es} for m, es in GRAPH.items()}
    # strongly connected components (Tarjan); any component of two or more modules is a cycle
    index, low, stack, on, comps = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                comps.append(sorted(comp))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    assert not comps, "import cycles:\n" + "\n".join(" <-> ".join(c) for c in comps)


def test_no_private_imports_across_modules():
    wrong = [
        f"{m}:{line} imports {t}.{n}"
        for m, es in GRAPH.items()
        for t, names, line in es
        for n in names
        if n.startswith("_") and not n.startswith("__")
    ]
    assert not wrong, "\n".join(wrong)


def _justified() -> set[str]:
    text = (ROOT / "docs" / "architecture.md").read_text()
    section = text.split("## Large classes", 1)
    if len(section) < 2:
        return set()
    body = section[1].split("\n## ", 1)[0]
    return set(re.findall(r"`([A-Za-z_][A-Za-z0-9_]*)`", body))


def test_classes_are_small_or_justified():
    justified = _justified()
    big = []
    for m, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                n = node.end_lineno - node.lineno + 1
                if n > MAX_CLASS_LINES and node.name not in justified:
                    big.append(f"{m}.{node.name}: {n} lines")
    assert not big, (
        f"classes over {MAX_CLASS_LINES} lines (split them, or say why in docs/architecture.md's "
        '"Large classes" section):\n' + "\n".join(big)
    )

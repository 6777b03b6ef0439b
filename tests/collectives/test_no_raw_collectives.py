"""No package code calls a torch.distributed collective except through `collectives`.

A raw call takes its tensor where the caller left it, which on an NCCL group must be the GPU: a
host tensor there fails only on a GPU machine (the review's A1-A3, B3). The rule is checked on
the source (every call, in functions too): a collective reached through a name bound to
`torch.distributed` (`dist.all_reduce`, `torch.distributed.broadcast`, a name imported from
it), or a ProcessGroup's own methods (`pg.allreduce`, `self.pg.broadcast`).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("miles_like", "rollout", "trainer", "weight_sync", "native_build", "model_spec")
HELPER = ROOT / "collectives"

COLLECTIVES = {
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_object",
    "all_reduce",
    "all_to_all",
    "all_to_all_single",
    "barrier",
    "batch_isend_irecv",
    "broadcast",
    "broadcast_object_list",
    "gather",
    "gather_object",
    "irecv",
    "isend",
    "monitored_barrier",
    "recv",
    "recv_object_list",
    "reduce",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "scatter",
    "scatter_object_list",
    "send",
    "send_object_list",
}
# a ProcessGroup object's own collectives (c10d's names)
PG_METHODS = {
    "allreduce",
    "allreduce_coalesced",
    "allgather",
    "allgather_coalesced",
    "allgather_into_tensor_coalesced",
    "alltoall",
    "alltoall_base",
    "reduce_scatter",
    "_allgather_base",
    "_reduce_scatter_base",
}
PG_NAMES = {"pg", "process_group", "_pg"}


def raw_collective_calls(source: str) -> list[tuple[int, str]]:
    """(line, call) of every raw collective call in `source`."""
    tree = ast.parse(source)
    dist_names, torch_names, direct = set(), set(), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name == "torch.distributed" and alias.asname:
                    dist_names.add(alias.asname)
                elif alias.name.split(".")[0] == "torch":
                    torch_names.add(alias.asname or "torch")
        elif isinstance(node, ast.ImportFrom):
            for alias in node.names:
                if node.module == "torch" and alias.name == "distributed":
                    dist_names.add(alias.asname or alias.name)
                elif node.module == "torch.distributed" and alias.name in COLLECTIVES:
                    direct.add(alias.asname or alias.name)
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        f = node.func
        if isinstance(f, ast.Name) and f.id in direct:
            found.append((node.lineno, f.id))
        if not isinstance(f, ast.Attribute):
            continue
        owner = f.value
        owner_name = (
            owner.id
            if isinstance(owner, ast.Name)
            else owner.attr
            if isinstance(owner, ast.Attribute)
            else None
        )
        via_dist = f.attr in COLLECTIVES and (
            (isinstance(owner, ast.Name) and owner.id in dist_names)
            or (
                isinstance(owner, ast.Attribute)
                and owner.attr == "distributed"
                and isinstance(owner.value, ast.Name)
                and owner.value.id in torch_names
            )
        )
        via_pg = f.attr in PG_METHODS or (
            owner_name in PG_NAMES and (f.attr in COLLECTIVES or f.attr in PG_METHODS)
        )
        if via_dist or via_pg:
            found.append((node.lineno, ast.unparse(f)))
    return found


@pytest.mark.parametrize(
    "source",
    [
        "import torch.distributed as dist\ndef f(x):\n    dist.all_reduce(x)\n",
        "import torch\nclass A:\n    def f(self, x):\n        torch.distributed.broadcast(x, 0)\n",
        "import torch.distributed\ntorch.distributed.all_gather_object([], 1)\n",
        "from torch import distributed as d\nd.all_to_all_single(a, b)\n",
        "from torch.distributed import all_reduce as ar\nar(x)\n",
        "class G:\n    def b(self, t, src):\n        self.pg.broadcast(t, src).wait()\n",
        "def f(group, t):\n    group.allreduce([t]).wait()\n",
    ],
)
def test_the_check_sees_each_form_of_raw_call(source):
    assert raw_collective_calls(source)


def test_the_check_passes_helper_calls_and_non_collectives():
    source = (
        "import torch.distributed as dist\nimport collectives\n"
        "collectives.all_reduce(x, group=g)\nself.group.broadcast(t, 0)\n"
        "dist.get_world_size(g)\ndist.init_process_group('gloo')\n"
    )
    assert raw_collective_calls(source) == []


def test_the_helper_is_where_the_raw_calls_are():
    assert raw_collective_calls((HELPER / "ops.py").read_text())


def test_no_raw_collective_outside_the_helper():
    wrong = [
        f"{path.relative_to(ROOT)}:{line} {call}"
        for pkg in PACKAGES
        for path in sorted((ROOT / pkg).rglob("*.py"))
        for line, call in raw_collective_calls(path.read_text())
    ]
    assert not wrong, "call these through `collectives`:\n" + "\n".join(wrong)

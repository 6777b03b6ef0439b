"""The controller never touches CUDA, and the workers compute where the recipe says.

The controller is a plain process that sees every GPU of its node: one `torch.cuda` call that
creates a context there (an RNG state read, a `set_device`) takes memory on every GPU, after
the engines sized their KV pools. So the controller's RNG checkpoint holds host generators only,
and under `miles_like/run/` every CUDA call sits inside a worker actor class (a `@ray.remote`
class: it runs in the actor's process, on the one GPU Ray gave it).

A worker's device and collective backend follow `cluster.accelerator` as passed into it
(`trainer.device_choice`), not `torch.cuda.is_available()` inside it: `accelerator: cpu` on a
machine with GPUs builds on the CPU with gloo.
"""

from __future__ import annotations

import ast
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from miles_like.run import rng_state

ROOT = Path(__file__).resolve().parents[2]
RUN = ROOT / "miles_like" / "run"


def test_rng_capture_and_restore_make_no_cuda_call(monkeypatch):
    """With CUDA claiming to be there and every CUDA RNG / device call raising, the controller's
    capture and restore still replay the host generators exactly."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)

    def refuse(*_args, **_kwargs):
        raise AssertionError("the controller called torch.cuda")

    for name in (
        "get_rng_state",
        "get_rng_state_all",
        "set_rng_state",
        "set_rng_state_all",
        "set_device",
        "current_device",
        "device_count",
        "init",
        "manual_seed_all",
    ):
        monkeypatch.setattr(torch.cuda, name, refuse)
    state = rng_state.capture()
    drawn = (torch.rand(3), random.random(), np.random.rand())
    rng_state.restore(state)
    again = (torch.rand(3), random.random(), np.random.rand())
    assert torch.equal(drawn[0], again[0]) and drawn[1:] == again[1:]
    assert set(state) == {"torch", "python", "numpy"}


def _is_ray_remote(node: ast.ClassDef) -> bool:
    for d in node.decorator_list:
        target = d.func if isinstance(d, ast.Call) else d
        if isinstance(target, ast.Attribute) and target.attr == "remote":
            return True
    return False


def _cuda_calls(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, call) of each `torch.cuda...(...)` call outside `@ray.remote` classes."""
    found: list[tuple[int, str]] = []

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.ClassDef) and _is_ray_remote(node):
            return
        if isinstance(node, ast.Call):
            text = ast.unparse(node.func)
            if text.startswith("torch.cuda.") or text == "torch.cuda":
                found.append((node.lineno, text))
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return found


def test_the_ast_check_sees_cuda_calls():
    """The check itself: a call at module level or in a plain class is seen; in a worker, not."""
    tree = ast.parse(
        "import ray, torch\n"
        "torch.cuda.set_device(0)\n"
        "class Plain:\n    def f(self):\n        return torch.cuda.get_rng_state_all()\n"
        "@ray.remote\nclass Worker:\n    def f(self):\n        torch.cuda.set_device(0)\n"
        "@ray.remote(num_gpus=1)\nclass Other:\n"
        "    def f(self):\n        torch.cuda.synchronize()\n"
    )
    assert _cuda_calls(tree) == [(2, "torch.cuda.set_device"), (5, "torch.cuda.get_rng_state_all")]


def test_no_cuda_call_under_run_outside_worker_classes():
    modules = sorted(RUN.glob("*.py"))
    assert len(modules) > 10
    calls = {str(p.relative_to(ROOT)): _cuda_calls(ast.parse(p.read_text())) for p in modules}
    assert {k: v for k, v in calls.items() if v} == {}


@pytest.mark.parametrize("accelerator,device", [("cpu", "cpu"), ("cuda", "cuda:0")])
def test_device_for_the_accelerator(accelerator, device):
    from trainer import device_choice

    assert device_choice.device_for(accelerator) == torch.device(device)
    assert device_choice.backend_for(device) == ("nccl" if accelerator == "cuda" else "gloo")


def test_device_for_refuses_auto():
    """`auto` is resolved once, by the controller (`ClusterSection.device_type`)."""
    from trainer import device_choice

    with pytest.raises(ValueError, match="'auto'"):
        device_choice.device_for("auto")


CPU_ON_A_GPU_HOST = """
import torch
torch.cuda.is_available = lambda: True  # a GPU host, as far as anything asking can tell

def refusing(name):
    def refuse(*args, **kwargs):
        raise AssertionError(f"touched CUDA: torch.cuda.{name}")
    return refuse

torch.cuda.set_device = refusing("set_device")
torch.cuda.current_device = refusing("current_device")
from miles_like.run import rendezvous
from trainer import cpu_compat, device_choice, parallel

rendezvous.start_actor_process(1, device_choice.device_for("cpu"))  # what a trainer actor does
parallel.init_parallel(1, 1)
import torch.distributed as dist
print(dist.get_backend(), parallel.device(), rendezvous.collective_backend(), cpu_compat.needed())
"""


def test_accelerator_cpu_on_a_gpu_host_builds_cpu_and_gloo():
    """In a fresh process (the actor's), torch.cuda claims a GPU: the trainer's world, its
    device and the actor's groups still follow `accelerator: cpu`."""
    out = subprocess.run(
        [sys.executable, "-c", CPU_ON_A_GPU_HOST],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={"PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"},
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split()[-4:] == ["gloo", "cpu", "gloo", "True"]

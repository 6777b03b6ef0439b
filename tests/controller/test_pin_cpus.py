"""cluster.pin_cpus: each bundle's worker process runs on its own cores.

* the plan gives bundle b the b-th run of cpu_threads cores of those the controller may use;
  colocated, or more cores than there are, is one RecipeError line;
* a trainer placed by `placement.create_trainers` on a pinned layout has every thread of its
  process (read from /proc, not from the worker) on its bundle's core, and so has a thread it
  starts afterwards.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import ray

from miles_like.recipe import RecipeError, load_recipe
from miles_like.run import placement

ROOT = Path(__file__).resolve().parents[2]
RECIPE = ROOT / "recipes" / "tiny_arith_grpo.yaml"
MINE = sorted(os.sched_getaffinity(0))
PINNED = ["cluster.colocate=false", "cluster.accelerator=cpu", "cluster.pin_cpus=true"]


def test_plan_gives_each_bundle_its_own_cores():
    r = load_recipe(RECIPE, [*PINNED, "cluster.devices=2", "cluster.cpu_threads=1"])
    assert placement.plan(r.cluster).cpus == ((MINE[0],), (MINE[1],))
    unpinned = load_recipe(RECIPE, ["cluster.colocate=false", "cluster.devices=2"])
    assert placement.plan(unpinned.cluster).cpus == ()


def test_too_many_cores_or_colocated_is_one_line():
    r = load_recipe(RECIPE, [*PINNED, f"cluster.devices={len(MINE) + 1}", "cluster.cpu_threads=1"])
    with pytest.raises(RecipeError, match=r"^cluster\.pin_cpus=true needs cluster\.devices"):
        placement.plan(r.cluster)
    with pytest.raises(RecipeError, match=r"^cluster\.pin_cpus=true .* cluster\.colocate: false$"):
        load_recipe(RECIPE, ["cluster.pin_cpus=true", "cluster.devices=2"])


def _allowed(pid: int) -> dict[int, str]:
    """Cpus_allowed_list of every thread of process `pid`, by thread id."""
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        status = Path(f"/proc/{pid}/task/{tid}/status").read_text()
        (line,) = [x for x in status.splitlines() if x.startswith("Cpus_allowed_list:")]
        out[int(tid)] = line.split(":", 1)[1].strip()
    return out


def _start_thread(worker) -> int:
    import threading

    done = threading.Event()
    thread = threading.Thread(target=done.wait, daemon=True)
    thread.start()
    worker._probe = done  # kept waiting, so it is still there to be read
    return thread.native_id


def test_a_pinned_worker_runs_every_thread_on_its_core(ray_local):
    r = load_recipe(RECIPE, [*PINNED, "cluster.devices=2", "cluster.cpu_threads=1"])
    layout = placement.plan(r.cluster)
    pg = placement.reserve(layout)
    try:
        (trainer,) = placement.create_trainers(layout, pg, "pintest", 120.0)
        pid = ray.get(trainer.__ray_call__.remote(lambda self: os.getpid()))
        core = str(layout.cpus[layout.trainer_bundles[0]][0])
        assert set(_allowed(pid).values()) == {core}
        later = ray.get(trainer.__ray_call__.remote(_start_thread))
        assert _allowed(pid)[later] == core
        ray.kill(trainer)
    finally:
        ray.util.remove_placement_group(pg)

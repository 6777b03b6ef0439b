"""Ray placement: one placement group, one bundle per device, and the actors placed on it.

Colocated (default): trainer rank i and engine replica i share bundle i (each takes half of its
resources) and the controller alternates their phases. Disaggregated: the first
`devices - rollout_devices` bundles hold trainer ranks, the rest engines; both sides can run at
once. On a machine without CUDA a "device" is a CPU slot (a bundle of 1 CPU) and the workers run
torch on `usable_cpus() // devices` threads each; the code path is the same.
"""

from __future__ import annotations

import os
from typing import NamedTuple

import ray
import torch
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from miles_like.calls import call, each, gather
from miles_like.workers import EngineWorker, TrainerWorker


class Layout(NamedTuple):
    accelerator: str  # "cpu" | "cuda"
    devices: int
    trainer_bundles: list[int]  # bundle of each trainer rank
    engine_bundles: list[int]  # bundle of each engine replica
    colocated: bool
    threads: int  # torch threads per worker on CPU


def usable_cpus() -> int:
    """The CPUs this process may run on (taskset, cgroup cpusets), not every CPU of the
    machine; `os.cpu_count()` where the OS cannot say."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def plan(cluster) -> Layout:
    """Where every actor goes, from the recipe's cluster section."""
    accelerator = cluster.accelerator
    if accelerator == "auto":
        accelerator = "cuda" if torch.cuda.is_available() else "cpu"
    d = cluster.devices
    threads = max(1, usable_cpus() // d)
    if cluster.colocate:
        return Layout(accelerator, d, list(range(d)), list(range(d)), True, threads)
    r = cluster.rollout_devices if cluster.rollout_devices is not None else d // 2
    return Layout(accelerator, d, list(range(d - r)), list(range(d - r, d)), False, threads)


def start_ray(cluster, layout: Layout) -> None:
    """Connect to `cluster.address`, or start a local Ray sized for the layout, with no dashboard
    (it would take job submissions from anyone reaching its port). Ray's own GCS and node ports
    still listen on the node's address (Ray 2.60 ignores `_node_ip_address` for binding), guarded
    by Ray's token authentication."""
    if ray.is_initialized():
        return
    env = {
        "env_vars": {
            "PYTHONPATH": os.pathsep.join(
                p for p in (os.getcwd(), os.environ.get("PYTHONPATH", "")) if p
            )
        }
    }
    if cluster.address is not None:
        ray.init(address=cluster.address, runtime_env=env, log_to_driver=True)
        return
    ray.init(
        num_cpus=max(layout.devices, os.cpu_count() or 1),
        num_gpus=layout.devices if layout.accelerator == "cuda" else 0,
        include_dashboard=False,
        _node_ip_address="127.0.0.1",
        runtime_env=env,
        log_to_driver=True,
        configure_logging=False,
    )


def _options(layout: Layout, pg, bundle: int):
    share = 0.5 if layout.colocated else 1.0
    return dict(
        num_cpus=share,
        num_gpus=share if layout.accelerator == "cuda" else 0,
        scheduling_strategy=PlacementGroupSchedulingStrategy(
            placement_group=pg, placement_group_bundle_index=bundle
        ),
    )


def reserve(layout: Layout, timeout_s: float = 300.0, strategy: str = "PACK"):
    """The placement group: one bundle per device."""
    bundle = {"CPU": 1.0}
    if layout.accelerator == "cuda":
        bundle["GPU"] = 1.0
    pg = placement_group([dict(bundle) for _ in range(layout.devices)], strategy=strategy)
    if not pg.wait(timeout_seconds=timeout_s):
        raise RuntimeError(
            f"Ray could not reserve {layout.devices} x {bundle} within "
            f"{timeout_s:.0f} s; lower cluster.devices or add resources"
        )
    return pg


def create_trainers(layout: Layout, pg, tag: str, timeout_s: float) -> list:
    """One TrainerWorker per trainer rank, joined into one torch.distributed world (built later:
    `TrainerWorker.build`). Actors are named `miles_like.{tag}.trainer.{rank}`. The world meets
    at an address and port rank 0 chose on its own node (it may not be the controller's)."""
    world = len(layout.trainer_bundles)
    trainers = [
        TrainerWorker.options(
            name=f"miles_like.{tag}.trainer.{rank}", **_options(layout, pg, b)
        ).remote(rank, world, layout.threads)
        for rank, b in enumerate(layout.trainer_bundles)
    ]
    gather(each("trainer rank", trainers, "ready"), timeout_s)
    ((host, port),) = gather([call("trainer rank 0", trainers[0], "rendezvous")], timeout_s)
    gather(each("trainer rank", trainers, "set_rendezvous", host, port), timeout_s)
    return trainers


def engine_name(tag: str, index: int, restarts: int = 0) -> str:
    return f"miles_like.{tag}.engine.{index}" + (f".restart{restarts}" if restarts else "")


def create_engines(
    layout: Layout,
    pg,
    engine_cfg,
    names: list[str],
    timeout_s: float,
    indices: list[int] | None = None,
) -> list:
    """EngineWorkers `indices` (default all) in their bundles, named `names`, ready."""
    indices = list(range(len(layout.engine_bundles))) if indices is None else indices
    engines = [
        EngineWorker.options(name=name, **_options(layout, pg, layout.engine_bundles[i])).remote(
            engine_cfg, layout.threads
        )
        for i, name in zip(indices, names, strict=True)
    ]
    gather([call(f"engine {i}", e, "ready") for i, e in zip(indices, engines)], timeout_s)
    return engines


def release(pg, actors: list) -> None:
    for a in actors:
        ray.kill(a)
    remove_placement_group(pg)

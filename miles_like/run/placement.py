"""Ray placement: one placement group, one bundle per device, and the actors placed on it.

Colocated (default): trainer rank i and engine replica i share bundle i (each takes half of its
resources) and the controller alternates their phases. Disaggregated: the first
`devices - rollout_devices` bundles hold trainer ranks, the rest engines; both sides can run at
once. On a machine without CUDA a "device" is a CPU slot (a bundle of 1 CPU) and the workers run
torch on `cluster.cpu_threads` threads each (default `default_threads`); the code path
is the same.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import NamedTuple

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from miles_like.recipe.build_configs import engine_config
from miles_like.run import orphans
from miles_like.run.calls import start_call, start_on_all, wait_all
from miles_like.run.engine_worker import EngineWorker
from miles_like.run.trainer_worker import TrainerWorker


class Layout(NamedTuple):
    accelerator: str  # "cpu" | "cuda"
    devices: int
    trainer_bundles: list[int]  # bundle of each trainer rank
    engine_bundles: list[int]  # bundle of each engine replica
    colocated: bool
    threads: int  # torch threads per worker on CPU
    engine_tp: int = 1  # ranks per engine replica: replica i holds engine_bundles[i k : (i+1) k]
    # cluster.pin_cpus: the cores of each bundle's worker (bundle b: the b-th `threads` of the
    # cores the controller may use); () unpinned
    cpus: tuple[tuple[int, ...], ...] = ()
    # engines and trainer take turns holding the devices' memory: colocated on GPUs. Elsewhere
    # the loop's memory calls do nothing (on CPU there is no device memory to hand over)
    staged_memory: bool = False

    @property
    def num_replicas(self) -> int:
        return len(self.engine_bundles) // self.engine_tp

    def replica_bundles(self, index: int) -> list[int]:
        k = self.engine_tp
        return self.engine_bundles[index * k : (index + 1) * k]


def usable_cpus() -> int:
    """The CPUs this process may run on (taskset, cgroup cpusets), not every CPU of the
    machine; `os.cpu_count()` where the OS cannot say."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def default_threads(devices: int) -> int:
    """Torch threads per worker where `cluster.cpu_threads` is unset: the usable cores split
    over the devices, at most `$OMP_NUM_THREADS` where the environment sets it (the launcher's
    word for how many threads a process may use, as torch reads it: a shared machine, a test
    runner with runs side by side, where each run's threads would spin waiting for one another
    on cores the other runs hold)."""
    threads = max(1, usable_cpus() // devices)
    omp = os.environ.get("OMP_NUM_THREADS", "").split(",")[0].strip()  # "4" or nested "4,2"
    cap = int(omp) if omp.isdigit() else 0
    return min(threads, cap) if cap > 0 else threads


def plan(cluster, engine_tp: int = 1) -> Layout:
    """Where every actor goes, from the recipe's cluster section and `rollout.tp` (`engine_tp`
    consecutive engine bundles per replica; the recipe checks it divides them). Colocated,
    engine rank j of replica i shares bundle i k + j with trainer rank i k + j, so trainer TP
    rank r (innermost in megatron's rank order) sits with engine TP rank r."""
    accelerator = cluster.device_type()
    d = cluster.devices
    threads = cluster.cpu_threads or default_threads(d)
    cpus: tuple[tuple[int, ...], ...] = ()
    if cluster.pin_cpus and accelerator == "cpu":
        mine = sorted(os.sched_getaffinity(0))
        if d * threads > len(mine):
            from miles_like.errors import RecipeError

            raise RecipeError(
                f"cluster.pin_cpus=true needs cluster.devices x cpu_threads = {d * threads} "
                f"cores, this process may use {len(mine)}; lower cluster.cpu_threads or set "
                "cluster.pin_cpus: false"
            )
        cpus = tuple(tuple(mine[b * threads : (b + 1) * threads]) for b in range(d))
    if cluster.colocate:
        return Layout(
            accelerator,
            d,
            list(range(d)),
            list(range(d)),
            True,
            threads,
            engine_tp,
            staged_memory=accelerator == "cuda",
        )
    r = cluster.rollout_devices if cluster.rollout_devices is not None else d // 2
    return Layout(
        accelerator, d, list(range(d - r)), list(range(d - r, d)), False, threads, engine_tp, cpus
    )


def engine_settings(recipe, layout: Layout, model_dir: Path):
    """The `EngineConfig` of every engine rank, loading `model_dir`."""
    device = "cuda" if layout.accelerator == "cuda" else "cpu"
    return engine_config(recipe, str(model_dir), device)


def start_ray(cluster, layout: Layout) -> None:
    """Connect to `cluster.address`, or start a local Ray sized for the layout, with no dashboard
    (it would take job submissions from anyone reaching its port). Ray's own GCS and node ports
    still listen on the node's address (Ray 2.60 ignores `_node_ip_address` for binding), guarded
    by Ray's token authentication.

    The local Ray starts its workers at niceness 0 (`worker_niceness`), not Ray's default 15:
    the trainer ranks and engines are the run's compute, and at 15 any other process on the
    machine (another job, a test suite) takes nearly all the CPU from them (scheduler weight 36
    against 1024)."""
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
        orphans.reassert_sigterm()
        return
    ray.init(
        num_cpus=max(layout.devices, os.cpu_count() or 1),
        num_gpus=layout.devices if layout.accelerator == "cuda" else 0,
        include_dashboard=False,
        _node_ip_address="127.0.0.1",
        runtime_env=env,
        log_to_driver=True,
        configure_logging=False,
        _system_config={"worker_niceness": 0},
    )
    orphans.reassert_sigterm()


def actor_options(layout: Layout, pg, bundle: int):
    """Ray options of an actor in `bundle`: colocated, trainer rank i and engine i each take
    half of bundle i, and so share its GPU."""
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
            name=f"miles_like.{tag}.trainer.{rank}", **actor_options(layout, pg, b)
        ).remote(rank, world, layout.threads, layout.accelerator)
        for rank, b in enumerate(layout.trainer_bundles)
    ]
    wait_all(start_on_all("trainer rank", trainers, "ready"), timeout_s)
    pin(layout, trainers, layout.trainer_bundles, "trainer rank", timeout_s)
    ((host, port),) = wait_all([start_call("trainer rank 0", trainers[0], "rendezvous")], timeout_s)
    wait_all(start_on_all("trainer rank", trainers, "set_rendezvous", host, port), timeout_s)
    return trainers


def pin(layout: Layout, actors: list, bundles: list[int], role: str, timeout_s: float) -> None:
    """cluster.pin_cpus: every thread of each actor's process onto its bundle's cores."""
    if layout.cpus:
        wait_all(
            [
                start_call(f"{role} {k}", a, "pin_cpus", list(layout.cpus[b]))
                for k, (a, b) in enumerate(zip(actors, bundles))
            ],
            timeout_s,
        )


def engine_name(tag: str, index: int, restarts: int = 0) -> str:
    return f"miles_like.{tag}.engine.{index}" + (f".restart{restarts}" if restarts else "")


def create_engines(
    layout: Layout,
    pg,
    engine_cfg,
    names: list[str],
    timeout_s: float,
    indices: list[int] | None = None,
    return_routes: bool = False,
) -> list[list]:
    """Engine replicas `indices` (default all) in their bundles, named `names`, ready: each a list
    of its `layout.engine_tp` EngineWorkers, rank 0 first (named `names[i]`, rank j
    `names[i].rank{j}`). A TP replica's ranks meet where its rank 0 chose, on its node; then the
    followers serve (`EngineWorker.follow`) and rank 0 watches them. `return_routes`: they
    return a mixture's routes with its samples (routing replay)."""
    indices = list(range(layout.num_replicas)) if indices is None else indices
    k = layout.engine_tp
    replicas = [
        [
            EngineWorker.options(
                name=name if rank == 0 else f"{name}.rank{rank}", **actor_options(layout, pg, b)
            ).remote(engine_cfg, layout.threads, rank, return_routes)
            for rank, b in enumerate(layout.replica_bundles(i))
        ]
        for i, name in zip(indices, names, strict=True)
    ]
    labelled = [
        (f"engine {i}" + (f" rank {rank}" if rank else ""), actor)
        for i, ranks in zip(indices, replicas)
        for rank, actor in enumerate(ranks)
    ]
    wait_all([start_call(label, a, "ready") for label, a in labelled], timeout_s)
    for i, ranks in zip(indices, replicas):
        pin(layout, ranks, layout.replica_bundles(i), f"engine {i} rank", timeout_s)
    if k == 1:
        return replicas
    meet = wait_all(
        [start_call(f"engine {i}", r[0], "rendezvous") for i, r in zip(indices, replicas)],
        timeout_s,
    )
    wait_all(
        [
            start_call(label, a, "start_tp", *meet[n // k], timeout_s)
            for n, (label, a) in enumerate(labelled)
        ],
        timeout_s,
    )
    wait_all(
        [
            start_call(f"engine {i}", r[0], "watch_followers", [f.follow.remote() for f in r[1:]])
            for i, r in zip(indices, replicas)
        ],
        timeout_s,
    )
    return replicas


def release(pg, actors: list) -> None:
    for a in actors:
        ray.kill(a)
    remove_placement_group(pg)

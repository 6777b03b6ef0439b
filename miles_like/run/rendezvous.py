"""Where an actor's process groups meet, and what every actor process sets up about itself.

Every rendezvous address comes from the node hosting the group's rank 0 (never the controller's
host, which may be another machine, nor 127.0.0.1), and its port is held from the moment it is
chosen until rank 0 takes it (`held_rendezvous`, `take_held_store`).
"""

from __future__ import annotations

import os
from datetime import timedelta

import ray
import torch

from trainer import device_choice

_HELD_STORES: dict[int, object] = {}  # port -> the TCPStore master listening on it


def held_rendezvous() -> tuple[str, int]:
    """Where a group whose rank 0 is this process meets: an address of this node (chosen here,
    never on the controller's, which may be another machine) and a port that is never let go:
    a TCPStore master listens on it from the moment it is chosen until rank 0 takes it
    (`take_held_store`). A port probed free and closed again can be taken by any other process
    before the group binds it (seen: EADDRINUSE when a replica's TP group started)."""
    import torch.distributed as dist

    host = ray.util.get_node_ip_address()
    store = dist.TCPStore(
        host, 0, is_master=True, wait_for_workers=False, timeout=timedelta(minutes=30)
    )
    _HELD_STORES[store.port] = store
    return host, store.port


def take_held_store(port: int, timeout_s: float):
    """Rank 0 of a group met at `held_rendezvous()`'s port: the store listening there."""
    store = _HELD_STORES.pop(port)
    store.set_timeout(timedelta(seconds=timeout_s))
    return store


def group_store(rank: int, host: str, port: int, timeout_s: float):
    """The store of a group met at `held_rendezvous()`'s (host, port): rank 0 chose the port and
    holds it; every other rank connects to it."""
    import torch.distributed as dist

    if rank == 0:
        return take_held_store(port, timeout_s)
    return dist.TCPStore(host, port, timeout=timedelta(seconds=timeout_s))


def node_id() -> str:
    return ray.get_runtime_context().get_node_id()


def use_node_interface() -> None:
    """Make gloo (and NCCL's bootstrap) talk over the interface holding this node's Ray address.
    By default they bind whatever the host name resolves to, often a loopback address, which a
    peer on another machine cannot reach. A user's own GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME
    wins."""
    import psutil

    ip = ray.util.get_node_ip_address()
    for name, addresses in psutil.net_if_addrs().items():
        if any(a.address == ip for a in addresses):
            os.environ.setdefault("GLOO_SOCKET_IFNAME", name)
            os.environ.setdefault("NCCL_SOCKET_IFNAME", name)
            return


def pin_process(cpus: list[int]) -> dict[int, list[int]]:
    """Every thread of this process onto `cpus` (threads started later inherit it from their
    creator, itself pinned). Returns each thread's affinity afterwards, by thread id."""
    out = {}
    for tid in map(int, os.listdir("/proc/self/task")):
        try:
            os.sched_setaffinity(tid, cpus)
            out[tid] = sorted(os.sched_getaffinity(tid))
        except ProcessLookupError:  # the thread ended meanwhile
            pass
    return out


def start_actor_process(threads: int, device: torch.device) -> None:
    """What every trainer and engine actor does first: talk over this node's interface, compute
    on `device` (the recipe's `cluster.accelerator`, never what this process happens to see:
    `trainer.device_choice`), run torch on `threads` threads. On a GPU the worker then makes the
    one device Ray gave it current (`CUDA_VISIBLE_DEVICES` names it: it is device 0 there); that
    call is the worker class's, as every CUDA call under `miles_like/run/` is, so that the
    controller, which imports this module, never touches CUDA."""
    use_node_interface()
    device_choice.use(device)
    torch.set_num_threads(max(1, threads))


def collective_backend() -> str:
    """The torch.distributed backend of the groups an actor joins: NCCL for an actor on a GPU,
    gloo on the CPU (`start_actor_process`'s device)."""
    return device_choice.backend_for(device_choice.current())

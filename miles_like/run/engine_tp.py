"""Tensor-parallel engine replicas: a replica of k = `rollout.tp` ranks is k `EngineWorker`s,
one per device. Rank 0 is the replica everywhere else (scheduler, AsyncEngine, HTTP endpoint,
every lifecycle call); the others replay its commands (`rollout.tp_follower`) and take part only
in the resharding sync (own shards). A replica lives and dies whole: a follower whose rank 0 is
gone exits, and rank 0 exits when a follower dies (`FollowerWatch`), so the controller sees an
actor death and replaces every rank (`RunActors.restart_engine`).
"""

from __future__ import annotations

import datetime
import os
import threading
from collections.abc import Callable

import ray

from miles_like.run.rendezvous import collective_backend, group_store


def join_replica_group(tp_rank: int, size: int, host: str, port: int, timeout_s: float) -> None:
    """Every rank of the replica at once: join its process group, which meets on rank 0's node
    (`held_rendezvous`). Collectives fail after `timeout_s`."""
    import torch.distributed as dist

    dist.init_process_group(
        collective_backend(),
        store=group_store(tp_rank, host, port, timeout_s),
        rank=tp_rank,
        world_size=size,
        timeout=datetime.timedelta(seconds=timeout_s),
    )


def serve_as_follower(follower, tp_rank: int) -> None:
    """A follower replays rank 0's commands until rank 0 stops the replica. If rank 0 is lost
    the collective fails and this process exits: the replica is dead without its rank 0."""
    try:
        follower.serve()
    except BaseException as e:  # noqa: BLE001 -- the replica is dead without its rank 0
        print(f"engine TP rank {tp_rank}: lost the replica ({e!r}); exiting", flush=True)
        os._exit(1)


class FollowerWatch:
    """Rank 0's watch over its followers' `follow` calls."""

    def __init__(self):
        self.follow_refs: list = []

    def watch(self, follow_refs: list) -> None:
        """Exit this process when a follower dies (its `follow` call fails), so that the replica
        is seen dead and replaced whole. Returns at once; a thread per follower waits."""

        def wait(ref) -> None:
            try:
                ray.get(ref)
            except Exception as e:  # noqa: BLE001 -- any failure of a rank kills the replica
                print(f"engine TP rank 0: a follower died ({e!r}); exiting", flush=True)
                os._exit(1)

        self.follow_refs = follow_refs
        for ref in follow_refs:
            threading.Thread(target=wait, args=(ref,), daemon=True).start()

    def intact(self, result: Callable):
        """`result()`; but when it fails on a TP replica because a rank is gone (its `follow`
        ended: the ranks are out of step for good), end this process, so that the controller
        sees the replica die and replaces it rather than reporting the error as the rollout's.
        (The watcher would end it too; this settles the race with the failed collective.)"""
        try:
            return result()
        except RuntimeError as e:
            if self.follow_refs and ray.wait(self.follow_refs, num_returns=1, timeout=10.0)[0]:
                print(f"engine TP rank 0: a rank is gone ({e!r}); exiting", flush=True)
                os._exit(1)
            raise

"""Pushing the trainer's weights into every engine: three strategies behind one `push()`.

* `ColocatedPush`: each engine shares its device (and node) with a trainer rank; the sources
  stream buckets through shared memory (CUDA IPC on GPU), or as bytes through Ray's object store
  to an engine on another node, then every engine commits.
* `ShardedColocatedPush` (the resharding sync, colocated): trainer TP = engine TP = k, megatron;
  trainer TP rank r streams its own shards, in the engine's layout, to rank r of every replica.
* `BroadcastPush` (disaggregated): sources and engines form standalone process groups
  (`join()`, at start and after an engine replacement) and the sources broadcast; with the
  resharding sync one group per TP rank index.

Every engine must be resumed (holding its memory) before a colocated push. A push returns one
report per trainer rank (`{"bytes": ...}`: zero on ranks that only take part in the gathers).
`in_place` (disaggregated, full tensors): the engines' running requests are kept, not drained;
they sample on with the new weights (`EngineWorker.receive_broadcast`).
"""

from __future__ import annotations

import math
from pathlib import Path

from miles_like.run.calls import start_call, start_on_all, wait_all
from weight_sync import DEFAULT_BUCKET_BYTES

MIB = 1 << 20


def bucket_bytes_for(model_dir: Path) -> int:
    """Sync buckets no larger than the model: a tiny model does not map 2 x 512 MiB."""
    size = sum(f.stat().st_size for f in model_dir.glob("*.safetensors"))
    return int(min(DEFAULT_BUCKET_BYTES, max(MIB, math.ceil(size / MIB) * MIB)))


class _Push:
    """What every strategy holds: the trainer ranks and the engine replicas (every rank, rank 0
    first; the same lists the run's actors hold, so a replaced engine is the push's too)."""

    def __init__(self, trainers: list, replicas: list, bucket_bytes: int, timeout_s: float):
        self.trainers, self.replicas = trainers, replicas
        self.bucket_bytes, self.timeout_s = bucket_bytes, timeout_s

    @property
    def engines(self) -> list:
        """Each replica's rank 0, which stands for the replica in every call but the resharding
        sync."""
        return [ranks[0] for ranks in self.replicas]

    def join(self) -> None:
        """Colocated: nothing to join."""

    def _commit(self) -> None:
        wait_all(start_on_all("engine", self.engines, "commit"), self.timeout_s)

    @staticmethod
    def _no_in_place(in_place: bool) -> None:
        if in_place:
            raise ValueError(
                "an in-place weight sync needs disaggregated engines taking full tensors "
                "(no resharding sync)"
            )


class ColocatedPush(_Push):
    def push(self, in_place: bool = False) -> list[dict]:
        self._no_in_place(in_place)
        engines = self.engines
        nodes = wait_all(start_on_all("engine", engines, "node_id"), self.timeout_s)
        reports = wait_all(
            start_on_all(
                "trainer rank",
                self.trainers,
                "push_colocated",
                engines,
                nodes,
                self.bucket_bytes,
                self.timeout_s,
            ),
            self.timeout_s,
        )
        self._commit()
        return reports


class ShardedColocatedPush(_Push):
    def push(self, in_place: bool = False) -> list[dict]:
        self._no_in_place(in_place)
        nodes = [
            wait_all(start_on_all(f"engine {i} rank", ranks, "node_id"), self.timeout_s)
            for i, ranks in enumerate(self.replicas)
        ]
        reports = wait_all(
            start_on_all(
                "trainer rank",
                self.trainers,
                "push_colocated_shards",
                self.replicas,
                nodes,
                self.bucket_bytes,
                self.timeout_s,
            ),
            self.timeout_s,
        )
        self._commit()
        return reports


class BroadcastPush(_Push):
    """`sharded`: the resharding sync, one broadcast group per TP rank index."""

    def __init__(self, *args, num_stages: int, sharded: bool):
        super().__init__(*args)
        self.num_stages, self.sharded = num_stages, sharded

    def join(self) -> None:
        """The engines and the trainer's sources form the broadcast group. Its rank 0 is engine 0,
        so it meets on engine 0's node. The resharding sync has one group per TP rank index r
        (engine rank r of every replica, trainer TP rank r of every stage), meeting on replica
        0's rank r."""
        if self.sharded:
            self._join_shard_groups()
            return
        engines, t = self.engines, self.timeout_s
        ((host, port),) = wait_all([start_call("engine 0", engines[0], "rendezvous")], t)
        e = len(engines)
        wait_all(
            [
                start_call(
                    f"engine {i}", eng, "join_sync_group", host, port, i, e, self.num_stages, t
                )
                for i, eng in enumerate(engines)
            ]
            + start_on_all(
                "trainer rank",
                self.trainers,
                "join_sync_group",
                host,
                port,
                e,
                self.num_stages,
                t,
            ),
            t,
        )

    def _join_shard_groups(self) -> None:
        t, e = self.timeout_s, len(self.replicas)
        groups = wait_all(start_on_all("engine 0 rank", self.replicas[0], "rendezvous"), t)
        wait_all(
            [
                start_call(
                    f"engine {i} rank {r}",
                    rank,
                    "join_sync_group",
                    *groups[r],
                    i,
                    e,
                    self.num_stages,
                    t,
                    True,
                )
                for i, ranks in enumerate(self.replicas)
                for r, rank in enumerate(ranks)
            ]
            + start_on_all(
                "trainer rank",
                self.trainers,
                "join_sync_group",
                None,
                None,
                e,
                self.num_stages,
                t,
                groups,
            ),
            t,
        )

    def push(self, in_place: bool = False) -> list[dict]:
        """Sources and engines meet in the broadcasts: one wait for all of them."""
        if self.sharded:
            self._no_in_place(in_place)
        receivers = (
            [
                start_call(f"engine {i} rank {r}", rank, "receive_broadcast")
                for i, ranks in enumerate(self.replicas)
                for r, rank in enumerate(ranks)
            ]
            if self.sharded
            else start_on_all("engine", self.engines, "receive_broadcast", in_place)
        )
        senders = start_on_all("trainer rank", self.trainers, "push_broadcast", self.bucket_bytes)
        return wait_all(senders + receivers, self.timeout_s)[: len(self.trainers)]


def weight_push(
    layout, trainer_section, trainers: list, replicas: list, bucket_bytes: int, timeout_s: float
) -> ColocatedPush | ShardedColocatedPush | BroadcastPush:
    """The strategy for this placement: trainer TP rank r feeds engine TP rank r its own shards
    when the sizes match (megatron), over either transport (the resharding sync)."""
    sharded = (
        layout.engine_tp > 1
        and trainer_section.tp == layout.engine_tp
        and trainer_section.backend == "megatron"
    )
    args = (trainers, replicas, bucket_bytes, timeout_s)
    if not layout.colocated:
        return BroadcastPush(*args, num_stages=trainer_section.pp, sharded=sharded)
    return ShardedColocatedPush(*args) if sharded else ColocatedPush(*args)

"""Pushing the trainer's weights into every engine: three strategies behind one `push()`.

* `ColocatedPush`: each engine shares its device (and node) with a trainer rank. Every trainer
  rank holds the full tensors of its pipeline stage (TP ranks after the export's all-gather, DP
  ranks as replicas), so each engine is fed by the rank of that stage on its own device, through
  shared memory (CUDA IPC on GPU); an engine with no rank of the stage on its device (another
  node; with pipeline parallelism, a GPU holding another stage) gets the stage's first rank's
  buckets as bytes through Ray's object store. Then every engine commits.
* `ShardedColocatedPush` (the resharding sync, colocated): trainer TP = engine TP = k, megatron;
  trainer TP rank r streams its own shards, in the engine's layout, to rank r of every replica,
  routed the same way among the ranks of each (stage, TP rank r).

Who feeds whom is `colocated_routes` / `sharded_routes`: a pure function of where each actor
is, `weight_sync.DeviceIdentity` (node, GPU UUID), which every actor computes inside itself: a
CUDA IPC handle opens only in a process that sees the sender's GPU, and device indices mean
nothing across processes (Ray gives each actor its own `CUDA_VISIBLE_DEVICES`).
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
from collections.abc import Hashable, Mapping
from pathlib import Path
from typing import NamedTuple, TypeVar

from miles_like.run.calls import start_call, start_on_all, wait_all
from weight_sync import DEFAULT_BUCKET_BYTES, DeviceIdentity, pair_colocated

MIB = 1 << 20
K = TypeVar("K", bound=Hashable)


class SenderPlace(NamedTuple):
    """Where a trainer rank sends from (`TrainerWorker.sync_place`): its device and which part
    of the model its export holds."""

    identity: DeviceIdentity
    stage: int  # pipeline stage
    tp_rank: int  # tensor-parallel rank (the resharding sync sends that rank's own shards)


class Routes(NamedTuple):
    """The receivers one trainer rank feeds in a colocated push."""

    shared: tuple  # through shared buffers: on this rank's device
    as_bytes: tuple  # as bytes through Ray's object store: no sender of the group on their device


def route_group(
    senders: Mapping[int, DeviceIdentity], receivers: Mapping[K, DeviceIdentity]
) -> dict[int, Routes]:
    """Senders holding the same tensors (ranks, lowest first) and the receivers they all must
    reach: a receiver on a sender's device is fed by the first such sender through shared
    buffers (`weight_sync.pair_colocated`); any other by the first sender, as bytes."""
    order = sorted(senders)
    held = set(senders.values())
    shareable = {k: i for k, i in receivers.items() if i in held}
    paired = pair_colocated({r: senders[r] for r in order}, shareable)
    routes = {r: Routes(paired[r], ()) for r in order}
    rest = tuple(k for k in receivers if k not in shareable)
    if rest:
        routes[order[0]] = routes[order[0]]._replace(as_bytes=rest)
    return routes


def colocated_routes(
    places: Mapping[int, SenderPlace], engines: Mapping[int, DeviceIdentity]
) -> dict[int, Routes]:
    """Full tensors: every engine gets every stage, from that stage's ranks."""
    routes: dict[int, Routes] = {}
    for stage in sorted({p.stage for p in places.values()}):
        senders = {r: p.identity for r, p in places.items() if p.stage == stage}
        routes.update(route_group(senders, engines))
    return routes


def sharded_routes(
    places: Mapping[int, SenderPlace], replicas: list[list[DeviceIdentity]]
) -> dict[int, Routes]:
    """The resharding sync: engine rank r of every replica (keyed by replica index) gets each
    stage's TP-rank-r shards, from the ranks of that stage and TP rank."""
    routes: dict[int, Routes] = {}
    for stage, r in sorted({(p.stage, p.tp_rank) for p in places.values()}):
        senders = {k: p.identity for k, p in places.items() if (p.stage, p.tp_rank) == (stage, r)}
        routes.update(route_group(senders, {i: ranks[r] for i, ranks in enumerate(replicas)}))
    return routes


def bucket_bytes_for(model_dir: Path) -> int:
    """Sync buckets no larger than the model: a tiny model does not map 2 x 512 MiB."""
    size = sum(f.stat().st_size for f in model_dir.glob("*.safetensors"))
    return int(min(DEFAULT_BUCKET_BYTES, max(MIB, math.ceil(size / MIB) * MIB)))


class _Push:
    """What every strategy holds: the trainer ranks and the engine replicas (every rank, rank 0
    first; the same lists the run's actors hold, so a replaced engine is the push's too)."""

    def __init__(
        self,
        trainers: list,
        replicas: list,
        bucket_bytes: int,
        timeout_s: float,
        quantization: str | None = None,
    ):
        self.trainers, self.replicas = trainers, replicas
        self.bucket_bytes, self.timeout_s = bucket_bytes, timeout_s
        # `rollout.quantization`: colocated senders quantize the linear weights they push; the
        # broadcast sends them as the trainer holds them and the engines quantize on load
        self.quantization = quantization

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


class _Routed(_Push):
    """A colocated push: each trainer rank sends to the receivers its routes name."""

    method = ""  # the trainer rank's call

    def __init__(self, *args):
        super().__init__(*args)
        self.places: dict[int, SenderPlace] | None = None  # trainer ranks never move

    def sender_places(self) -> dict[int, SenderPlace]:
        if self.places is None:
            found = wait_all(
                start_on_all("trainer rank", self.trainers, "sync_place"), self.timeout_s
            )
            self.places = {r: SenderPlace(*p) for r, p in enumerate(found)}
        return self.places

    def targets(self) -> list[tuple[list, list]]:
        """Each trainer rank's (shared, as bytes) receiver actors for this push (asked every
        push: an engine may have been replaced)."""
        raise NotImplementedError

    def push(self, in_place: bool = False) -> list[dict]:
        self._no_in_place(in_place)
        reports = wait_all(
            [
                start_call(
                    f"trainer rank {r}",
                    t,
                    self.method,
                    shared,
                    as_bytes,
                    self.bucket_bytes,
                    self.timeout_s,
                    self.quantization,
                )
                for r, (t, (shared, as_bytes)) in enumerate(zip(self.trainers, self.targets()))
            ],
            self.timeout_s,
        )
        self._commit()
        return reports


class ColocatedPush(_Routed):
    method = "push_colocated"

    def targets(self) -> list[tuple[list, list]]:
        engines = self.engines
        found = wait_all(start_on_all("engine", engines, "device_identity"), self.timeout_s)
        routes = colocated_routes(
            self.sender_places(), {i: DeviceIdentity(*x) for i, x in enumerate(found)}
        )
        return [
            ([engines[i] for i in routes[r].shared], [engines[i] for i in routes[r].as_bytes])
            for r in range(len(self.trainers))
        ]


class ShardedColocatedPush(_Routed):
    method = "push_colocated_shards"

    def targets(self) -> list[tuple[list, list]]:
        found = [
            wait_all(start_on_all(f"engine {i} rank", ranks, "device_identity"), self.timeout_s)
            for i, ranks in enumerate(self.replicas)
        ]
        places = self.sender_places()
        routes = sharded_routes(places, [[DeviceIdentity(*x) for x in ids] for ids in found])
        out = []
        for r in range(len(self.trainers)):
            tp = places[r].tp_rank
            out.append(
                (
                    [self.replicas[i][tp] for i in routes[r].shared],
                    [self.replicas[i][tp] for i in routes[r].as_bytes],
                )
            )
        return out


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
    layout,
    trainer_section,
    trainers: list,
    replicas: list,
    bucket_bytes: int,
    timeout_s: float,
    quantization: str | None = None,
) -> ColocatedPush | ShardedColocatedPush | BroadcastPush:
    """The strategy for this placement: trainer TP rank r feeds engine TP rank r its own shards
    when the sizes match (megatron), over either transport (the resharding sync)."""
    sharded = (
        layout.engine_tp > 1
        and trainer_section.tp == layout.engine_tp
        and trainer_section.backend == "megatron"
    )
    args = (trainers, replicas, bucket_bytes, timeout_s, quantization)
    if not layout.colocated:
        return BroadcastPush(*args, num_stages=trainer_section.pp, sharded=sharded)
    return ShardedColocatedPush(*args) if sharded else ColocatedPush(*args)

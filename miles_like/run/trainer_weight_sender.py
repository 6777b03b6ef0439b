"""A trainer rank's side of the weight push (`TrainerWorker` delegates to it).

Sources: the TP-rank-0 / DP-rank-0 process of every pipeline stage streams its stage's
`export_hf_weights()`; the other ranks drain the same generator (its TP all-gathers need them).
Colocated, each bucket goes to every engine through shared memory (handles + manifests travel
as Ray calls; the returned ObjectRefs are the acknowledgements that free the buffer), or as
bytes through Ray's object store to an engine on another node. Disaggregated, sources and
engines form a standalone process group and the sources broadcast. The resharding sync (trainer
TP = engine TP, megatron) sends every trainer TP rank's own shards, over either transport, to
the engine rank of the same TP index.
"""

from __future__ import annotations

from collections.abc import Sequence

import ray

from miles_like.run.rendezvous import collective_backend, node_id


class BucketAcks:
    """The acknowledgements of one bucket delivered to several engines: the bucket's buffer is
    free once every engine has acknowledged it (within `timeout_s`: a dead or hung engine fails
    the push instead of hanging it)."""

    def __init__(self, refs, timeout_s: float):
        self.refs, self.timeout_s = refs, timeout_s

    def result(self):
        return ray.get(self.refs, timeout=self.timeout_s)[0]


def drain(stream) -> dict[str, float]:
    """Run a rank's export to its end without sending (its collectives need every rank)."""
    for _ in stream:
        pass
    return {"bytes": 0.0}


class TrainerWeightSender:
    """One trainer rank's weight pushes. `policy` is the rank's trainer (its exports);
    `rank` its rank in the trainer world."""

    def __init__(self, policy, rank: int):
        self.policy, self.rank = policy, rank
        # colocated: the sender, and so its two shared buffers, lives across steps (mapping fresh
        # shared memory every step would cost more than the copy)
        self.colocated = None
        # where this call's buckets go: (engines on this node, engines on others, timeout,
        # whether they are own shards); set per push (an engine may have been replaced)
        self.targets: tuple = ((), (), 0.0, False)
        self.sync_group = None  # disaggregated: the broadcast group, on source ranks
        self.sync_sources: list[int] = []
        self.sharded_broadcast = False

    def role(self) -> tuple[bool, int]:
        """(is this rank a sync source, its pipeline stage)."""
        from megatron.core import parallel_state as ps

        if self.policy.cfg.backend == "megatron":
            source = ps.get_tensor_model_parallel_rank() == 0 and ps.get_data_parallel_rank() == 0
            return source, ps.get_pipeline_model_parallel_rank()
        return self.rank == 0, 0  # deepspeed: every rank can export the whole model

    # ------------------------------------------------------------------------------ colocated
    def push_colocated(
        self, engines: Sequence, engine_nodes: Sequence[str], bucket_bytes: int, timeout_s: float
    ) -> dict[str, float]:
        """Stream this rank's export into every engine of `engines`: through shared memory to
        those on this node, as bytes in Ray's object store to those on other nodes (`engine_nodes`
        are their node ids; shared memory and CUDA IPC do not cross machines). Returns the
        sender's report (zero bytes on ranks that only take part in the gathers)."""
        source, _ = self.role()
        if not source:
            return drain(self.policy.export_hf_weights())
        return self._send(
            self.policy.export_hf_weights(), engines, engine_nodes, False, timeout_s, bucket_bytes
        )

    def push_colocated_shards(
        self,
        replicas: Sequence[Sequence],
        replica_nodes: Sequence[Sequence[str]],
        bucket_bytes: int,
        timeout_s: float,
    ) -> dict[str, float]:
        """The resharding sync (trainer TP = engine TP = k, megatron): trainer TP rank r of
        data-parallel rank 0 (every pipeline stage) streams its own shards, converted to the
        engine's layout without a gather (`trainer.bridge.export_engine_shards`), to rank r of
        every replica (`replicas[i][r]`, on node `replica_nodes[i][r]`). Other data-parallel
        ranks drain the same export (its vocabulary exchange is a collective of their own TP
        group) and send nothing."""
        from megatron.core import parallel_state as ps

        shards = self.policy.export_engine_shards()
        if ps.get_data_parallel_rank() != 0:
            return drain(shards)
        r = ps.get_tensor_model_parallel_rank()
        targets = [ranks[r] for ranks in replicas]
        nodes = [n[r] for n in replica_nodes]
        return self._send(shards, targets, nodes, True, timeout_s, bucket_bytes)

    def _send(self, stream, engines, engine_nodes, own_shards: bool, timeout_s, bucket_bytes):
        from trainer.parallel import device
        from weight_sync import ColocatedSender

        here = node_id()
        self.targets = (
            [e for e, n in zip(engines, engine_nodes, strict=True) if n == here],
            [e for e, n in zip(engines, engine_nodes, strict=True) if n != here],
            timeout_s,
            own_shards,
        )
        if self.colocated is None:
            self.colocated = ColocatedSender(
                self._deliver, bucket_bytes=bucket_bytes, device=device()
            )
        report = self.colocated.send(stream)
        remote = len(self.targets[1])
        return {
            "bytes": float(report.nbytes),
            "buckets": float(report.num_buckets),
            "remote_bytes": float(report.nbytes * remote / max(1, len(engines))),
        }

    def _deliver(self, handle, manifest) -> BucketAcks:
        local, remote, timeout_s, own = self.targets
        refs = [e.load_bucket.remote(handle, manifest, own) for e in local]
        if remote:  # one copy into the object store, fetched by each remote node
            data = ray.put(self.colocated.allocator.buffer(handle).cpu().clone())
            refs += [e.load_bucket_bytes.remote(data, manifest, own) for e in remote]
        return BucketAcks(refs, timeout_s)

    # -------------------------------------------------------------------------- disaggregated
    def join_sync_group(
        self,
        host: str,
        port: int,
        num_engines: int,
        num_stages: int,
        timeout_s: float,
        shard_groups: Sequence[tuple[str, int]] | None = None,
    ) -> bool:
        """Disaggregated: sources join the standalone sync group with the engines (engines are
        ranks 0..E-1, the source of stage s is rank E+s): at start, and again with every member
        when an engine was replaced. Its collectives fail after `timeout_s`. Returns whether
        this rank joined.

        `shard_groups` (the resharding sync, trainer TP = engine TP = k): k groups, group r at
        `shard_groups[r]` holding engine rank r of every replica and the trainer TP rank r of
        data-parallel rank 0 of every stage, which broadcasts its own shards there."""
        from weight_sync import SyncGroup

        if shard_groups is not None:
            from megatron.core import parallel_state as ps

            self.sharded_broadcast = True
            if ps.get_data_parallel_rank() != 0:
                return False
            host, port = shard_groups[ps.get_tensor_model_parallel_rank()]
            source, stage = True, ps.get_pipeline_model_parallel_rank()
        else:
            self.sharded_broadcast = False
            source, stage = self.role()
        if source:
            self.sync_group = SyncGroup.create(
                host,
                port,
                rank=num_engines + stage,
                size=num_engines + num_stages,
                backend=collective_backend(),
                timeout_s=timeout_s,
            )
            self.sync_sources = list(range(num_engines, num_engines + num_stages))
        return source

    def push_broadcast(self, bucket_bytes: int) -> dict[str, float]:
        """Broadcast this stage's export over the sync group (see `join_sync_group`)."""
        from weight_sync import BroadcastSender

        if self.sharded_broadcast:  # every trainer TP rank of DP rank 0 feeds its shard group
            stream = self.policy.export_engine_shards()
            source = self.sync_group is not None
        else:
            stream = self.policy.export_hf_weights()
            source = self.role()[0]
        if not source:
            return drain(stream)
        report = BroadcastSender(
            self.sync_group, self.sync_sources, bucket_bytes=bucket_bytes
        ).send(stream)
        return {"bytes": float(report.nbytes), "buckets": float(report.num_buckets)}

    def close(self) -> None:
        if self.colocated is not None:
            self.colocated.close()

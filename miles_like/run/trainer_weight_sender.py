"""A trainer rank's side of the weight push (`TrainerWorker` delegates to it).

Colocated, every rank streams its stage's `export_hf_weights()` to the engines the controller
routed to it (`weight_push.colocated_routes`: the engine on its own device, through shared
memory; handles + manifests travel as Ray calls, the returned ObjectRefs are the
acknowledgements that free the buffer), or as bytes through Ray's object store to an engine no
rank of its stage shares a device with; a rank routed nothing drains the same generator (its TP
all-gathers need every rank). Disaggregated, the TP-rank-0 / DP-rank-0 process of every pipeline
stage is the source. Disaggregated, sources and
engines form a standalone process group and the sources broadcast. The resharding sync (trainer
TP = engine TP, megatron) sends every trainer TP rank's own shards, over either transport, to
the engine rank of the same TP index.
"""

from __future__ import annotations

from collections.abc import Sequence

import ray

from miles_like.run.rendezvous import collective_backend


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
        # colocated on the CPU, every engine on this host: small buckets handed over on a
        # socket of this rank's (`weight_sync.stream`), one engine call per push
        self.streamed = None
        self.bucket_stream = None
        # where this call's buckets go: (engines on this rank's device, engines fed bytes,
        # timeout, whether they are own shards); set per push (an engine may have been replaced)
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

    def place(self) -> tuple[int, int]:
        """(pipeline stage, tensor-parallel rank) of this rank's export."""
        from megatron.core import parallel_state as ps

        if self.policy.cfg.backend == "megatron":
            return ps.get_pipeline_model_parallel_rank(), ps.get_tensor_model_parallel_rank()
        return 0, 0  # deepspeed: data parallel only

    # ------------------------------------------------------------------------------ colocated
    def push_colocated(
        self,
        shared: Sequence,
        as_bytes: Sequence,
        bucket_bytes: int,
        timeout_s: float,
        quantization: str | None = None,
    ) -> dict[str, float]:
        """Stream this rank's export (its stage's full tensors) into the engines the controller
        routed to it (`weight_push.colocated_routes`): through shared memory to `shared`, which
        are on this rank's device, as bytes in Ray's object store to `as_bytes` (shared memory
        and CUDA IPC do not cross machines, nor GPUs a process cannot see). A rank with no
        engine drains the export (its TP all-gathers need every rank). `quantization` ("fp8"):
        the linear weights leave quantized (`weight_sync.quantize`). Returns the sender's
        report."""
        return self._send(
            self.policy.export_hf_weights(),
            shared,
            as_bytes,
            False,
            timeout_s,
            bucket_bytes,
            quantization,
        )

    def push_colocated_shards(
        self,
        shared: Sequence,
        as_bytes: Sequence,
        bucket_bytes: int,
        timeout_s: float,
        quantization: str | None = None,
    ) -> dict[str, float]:
        """The resharding sync (trainer TP = engine TP = k, megatron): this TP rank r's own
        shards, converted to the engine's layout without a gather
        (`trainer.bridge.export_engine_shards`), to the engine ranks of TP index r routed to it
        (`weight_push.sharded_routes`), as `push_colocated`. Every rank computes the export
        (its vocabulary exchange is a collective of the TP group)."""
        return self._send(
            self.policy.export_engine_shards(),
            shared,
            as_bytes,
            True,
            timeout_s,
            bucket_bytes,
            quantization,
        )

    def _send(
        self, stream, shared, as_bytes, own_shards: bool, timeout_s, bucket_bytes, quantization
    ):
        from trainer.parallel import device
        from weight_sync import ColocatedSender

        if not shared and not as_bytes:
            return drain(stream)
        if not as_bytes and device().type == "cpu":
            return self._stream(stream, shared, own_shards, timeout_s, bucket_bytes, quantization)
        self.targets = (list(shared), list(as_bytes), timeout_s, own_shards)
        if self.colocated is None:
            self.colocated = ColocatedSender(
                self._deliver, bucket_bytes=bucket_bytes, device=device(), quantization=quantization
            )
        report = self.colocated.send(stream)
        engines = len(shared) + len(as_bytes)
        return {
            "bytes": float(report.nbytes),
            "buckets": float(report.num_buckets),
            "remote_bytes": float(report.nbytes * len(as_bytes) / engines),
        }

    def _stream(self, stream, shared, own_shards: bool, timeout_s, bucket_bytes, quantization):
        """Every engine on this rank's host CPU: one `receive_stream` call per engine starts its
        side of a `weight_sync.BucketStream`, and the buckets (small, tensors split across
        them) go through shared memory with their hand-offs on the stream's socket."""
        from weight_sync import (
            STREAM_BUCKET_BYTES,
            STREAM_NUM_BUFFERS,
            BucketStream,
            ColocatedSender,
        )

        if self.streamed is None:
            self.bucket_stream = BucketStream()
            self.streamed = ColocatedSender(
                self.bucket_stream.deliver,
                bucket_bytes=min(bucket_bytes, STREAM_BUCKET_BYTES),
                quantization=quantization,
                num_buffers=STREAM_NUM_BUFFERS,
                split_tensors=True,
            )
        calls = [
            e.receive_stream.remote(self.bucket_stream.address, own_shards, timeout_s)
            for e in shared
        ]

        def failed_early() -> None:  # an engine whose call ended before it connected
            done, _ = ray.wait(calls, num_returns=len(calls), timeout=0)
            ray.get(done)

        try:
            self.bucket_stream.accept(len(shared), timeout_s, failed_early)
            report = self.streamed.send(stream)
            self.bucket_stream.finish()
        except BaseException:
            self.bucket_stream.abort()  # the engines' calls end now, the sync incomplete
            raise
        ray.get(calls, timeout=timeout_s)  # their own errors, if any (the acks said none)
        return {
            "bytes": float(report.nbytes),
            "buckets": float(report.num_buckets),
            "remote_bytes": 0.0,
        }

    def release(self) -> None:
        """Free the colocated bucket buffers (the trainer is leaving the device to the engines);
        the next push maps them again."""
        if self.colocated is not None:
            self.colocated.release()
        if self.streamed is not None:
            self.streamed.release()

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
        if self.streamed is not None:
            self.streamed.close()
            self.bucket_stream.close()

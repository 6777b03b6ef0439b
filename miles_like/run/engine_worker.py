"""One engine replica's rank as a Ray actor (`EngineWorker`): a rollout `Engine` behind an
`AsyncEngine` (its step loop is the only thread that runs the engine's requests).

The rollout window: `open()` admits requests (`generate_one`, the HTTP endpoint of `serve`),
`close()` stops admitting and waits for what is in flight. Lifecycle calls (`release`, `resume`,
`load_bucket`, `commit`, broadcasts, flushes) close the window themselves first, so no request
is ever served by half-updated weights. The batch `generate` works either way (closed, it opens
the window for its own duration).

Ray runs `generate_one`, `generate_wave`, `decode_wave` and `cancel_wave` in the `serve`
concurrency group, so many concurrent calls are batched together by the engine; `receive_stream`
runs in the `weights` group (see there); every other method is in the default group, one at a
time. Weight receiving is `EngineWeightReceiver`'s; the tensor-parallel ranks' control is
`engine_tp`'s.

The batch calls return each sample as a `RoutedSample`: with `return_routes` (routing replay)
a mixture of experts' routes travel with it, else none are sent.
"""

from __future__ import annotations

from collections.abc import Sequence

import ray
import torch

from miles_like.run import engine_tp
from miles_like.run.engine_endpoint import EngineEndpoint
from miles_like.run.engine_inspection import EngineInspection
from miles_like.run.engine_pd import CACHE_COUNTERS, CLOSED, PrefillDecodeRoles, cache_counters
from miles_like.run.engine_weight_receiver import EngineWeightReceiver
from miles_like.run.handoff_transport import HandoffReceiver, HandoffSender
from miles_like.run.rendezvous import held_rendezvous, pin_process, start_actor_process
from miles_like.run.rendezvous import node_id as this_node_id
from miles_like.run.routed_samples import finished_requests, routed_samples

__all__ = ["CLOSED", "EngineWorker"]


# "weights": one thread per trainer rank streaming to this engine in a sync (`receive_stream`);
# a sync has at most one per pipeline stage (per stage and TP rank in the resharding sync)
@ray.remote(concurrency_groups={"serve": 512, "tp": 1, "activity": 1, "handoff": 1, "weights": 64})
class EngineWorker(PrefillDecodeRoles, EngineEndpoint, EngineInspection):
    def __init__(self, engine_cfg, threads: int, tp_rank: int = 0, return_routes: bool = False):
        self.return_routes = return_routes  # a mixture's routes with its samples
        self.device = torch.device(engine_cfg.device)  # the recipe's accelerator
        start_actor_process(threads, self.device)
        if self.device.type == "cuda":
            torch.cuda.set_device(0)  # the one GPU Ray made visible to this actor
        self.cfg, self.tp_rank = engine_cfg, tp_rank
        self.on_gpu = self.device.type == "cuda"
        self.model_path = engine_cfg.model_path
        self._server = None
        self._prefill = None  # prefill-decode: the endpoint's `RemotePrefill`
        self._waves: dict[int, list] = {}  # generate_wave's futures by wave, while it runs
        self.engine = self.follower = None
        self.followers = engine_tp.FollowerWatch()
        if engine_cfg.tp == 1:
            self._build_engine()

    def _build_engine(self) -> None:
        from rollout import Engine
        from rollout.activity import ActivityLog
        from rollout.async_engine import AsyncEngine

        self.engine = Engine(self.cfg)
        self.engine.activity = ActivityLog()  # drained every step (take_activity)
        self.async_engine = AsyncEngine(self.engine, open=False)
        self.weights = EngineWeightReceiver(self.engine, self.async_engine, self.close)
        self.handoff_sender = HandoffSender(self.device)  # prefill-decode, both roles
        self.handoff_receiver = HandoffReceiver(self.device)

    def ready(self) -> bool:
        return True

    def pin_cpus(self, cpus: list[int]) -> dict[int, list[int]]:
        """cluster.pin_cpus (`placement.pin`): this process's threads onto `cpus`."""
        return pin_process(cpus)

    def rendezvous(self) -> tuple[str, int]:
        """Rank 0 of the replica's TP group and of the broadcast group (engine 0, or replica
        0's rank r for the resharding sync's group r): they meet on this engine's node, at a
        port this process holds until the group starts."""
        return held_rendezvous()

    def node_id(self) -> str:
        return this_node_id()

    def device_identity(self) -> tuple[str, str]:
        """(node, device) of this rank, for routing the colocated push (`weight_sync.identity`:
        the GPU's UUID, which names it in every process)."""
        from weight_sync import device_identity

        return device_identity(this_node_id(), self.device)

    # --------------------------------------------------------------- tensor-parallel replicas
    def start_tp(self, host: str, port: int, timeout_s: float) -> None:
        """Every rank of the replica at once: join its process group, then build this rank: the
        Engine on rank 0, a follower elsewhere (`follow` then serves it)."""
        engine_tp.join_replica_group(self.tp_rank, self.cfg.tp, host, port, timeout_s)
        if self.tp_rank == 0:
            self._build_engine()
            return
        from rollout.tp_follower import EngineFollower

        self.follower = EngineFollower(self.cfg)
        self.weights = EngineWeightReceiver(follower=self.follower, tp_rank=self.tp_rank)

    @ray.method(concurrency_group="tp")
    def follow(self) -> None:
        """Followers: replay rank 0's commands until it stops the replica (`shutdown`)."""
        engine_tp.serve_as_follower(self.follower, self.tp_rank)

    def watch_followers(self, follow_refs: list) -> None:
        """Rank 0: exit when a follower dies (`engine_tp.FollowerWatch`)."""
        self.followers.watch(follow_refs)

    # ------------------------------------------------------------------------ the rollout window
    def open(self) -> None:
        """Admit requests (after the weights of this rollout are in)."""
        self.async_engine.resume()

    def close(self, abort_running: bool = False) -> None:
        """Stop admitting; returns once nothing is in flight (or all of it was aborted)."""
        self.weights.end_in_place()  # a parked step loop would never drain
        self.async_engine.pause(abort_running=abort_running)

    def is_open(self) -> bool:
        return self.async_engine.is_open

    # ------------------------------------------------------------------------------ requests
    def generate(self, prompts: list[list[int]], params: list) -> tuple[list, dict[str, int]]:
        """Samples for every prompt, and what this call added to the engine's prefill / prefix-
        cache counters, plus the `weight_version` that sampled them (returned with the samples:
        no extra round trip for the hit rate; with the window open, `generate_one` calls running
        meanwhile are counted too)."""
        if not isinstance(params, Sequence):
            params = [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(
                f"got {len(params)} SamplingParams for {len(prompts)} prompts; "
                "give one or one per prompt"
            )
        from rollout.async_engine import held_open

        with held_open(self.async_engine):
            before = self.engine.stats()
            # all at once: admitted together, as Engine.generate does (no timing in the batch)
            futures = self.async_engine.submit_many(list(zip(prompts, params)))
            results = [self.followers.intact(f.result) for f in futures]
            after = self.engine.stats()
        # the window stays open for the whole call: no update can land between its requests
        return [routed_samples(r, self.return_routes) for r in results], {
            **cache_counters(before, after),
            "weight_version": results[0].weight_version if results else after["weight_version"],
        }

    @ray.method(num_returns="streaming")
    def generate_stream(
        self, prompts: list[list[int]], params: list, groups: list[int], quota: int | None
    ):
        """`generate` as a stream, for over-sampled rollouts: yields `(index, samples, weight
        version, per-sample token versions)` for each request as it finishes, then one dict:
        the counters of `generate` and `complete`, the groups (`groups[index]`) complete within
        `quota` in completion order (the rest of the batch was aborted once `quota` were:
        `AsyncEngine.submit_many`). The window is open for the whole call, so every sample of
        it has the one `weight_version` reported."""

        from rollout.async_engine import AsyncEngine, held_open

        with held_open(self.async_engine):
            before = self.engine.stats()
            futures = self.async_engine.submit_many(
                list(zip(prompts, params)), groups=groups, quota=quota
            )
            version = before["weight_version"]
            for item in finished_requests(futures, self.followers.intact, self.return_routes):
                version = item[2]
                yield item
            complete = AsyncEngine.complete_groups(futures).result() if futures else []
            after = self.engine.stats()
        yield {
            **cache_counters(before, after, (*CACHE_COUNTERS, "parked_reused_tokens")),
            "weight_version": version,
            "complete": complete,
        }

    @ray.method(num_returns="streaming", concurrency_group="serve")
    def generate_wave(self, prompts: list[list[int]], params: list, wave: int = 0):
        """The fully asynchronous producer's requests (`rollouts.async_producer`): admitted
        together, in order (as `generate`), in the serve group, so lifecycle calls (`close(
        abort_running=True)`, the weight sync, `stats`, `cancel_wave`) run while they generate.
        Yields `(index, samples, weight version, per-sample token versions)` as each request
        finishes (aborted ones with the tokens they have); with the window closed it yields
        CLOSED once and nothing else (nothing ran). `wave` names the call for `cancel_wave`."""

        from rollout.async_engine import EngineUnavailable

        try:
            futures = self.async_engine.submit_many(list(zip(prompts, params)))
        except EngineUnavailable:
            yield CLOSED
            return
        self._waves[wave] = futures
        try:
            yield from finished_requests(futures, self.followers.intact, self.return_routes)
        finally:
            self._waves.pop(wave, None)

    @ray.method(concurrency_group="serve")
    def cancel_wave(self, wave: int, indices: list[int]) -> None:
        """Abort requests `indices` of wave `wave` (`generate_wave`, `decode_wave`): those still
        running end now with the tokens they have; finished ones, or a wave that has ended, are
        left alone."""
        futures = self._waves.get(wave, ())
        for k in indices:
            if k < len(futures):
                self.async_engine.cancel(futures[k])

    @ray.method(concurrency_group="serve")
    def generate_one(self, prompt_ids: list[int], params):
        """One request, batched with every other concurrent call (the window must be open:
        closed, it raises `EngineUnavailable`). Returns a `GenerationResult`."""
        return self.followers.intact(self.async_engine.submit(prompt_ids, params).result)

    def stats(self) -> dict:
        """The engine's counters (`Engine.stats`), and the `prefill` calls this replica served
        (prefill-decode)."""
        return {**self.engine.stats(), "prefill_calls": self.prefill_calls}

    @ray.method(concurrency_group="activity")
    def take_activity(self) -> list:
        """The engine's forward passes since the last call (`rollout.activity.ForwardPass`); its
        own group, so it answers while a rollout's `generate` runs (off-policy steps)."""
        return self.engine.activity.take()

    # -------------------------------------------------------------------------------- memory
    def release(self) -> int:
        """Give the device to the trainer: the KV pool always; on GPU the weights too (the next
        sync refills every one of them)."""
        self.close()
        return self.engine.release_memory(weights=self.on_gpu)

    def resume(self) -> None:
        """`resume_weights` and `alloc_kv` at once."""
        self.close()
        self.engine.resume_memory()

    def resume_weights(self) -> None:
        """The weights' storage back, for the push (the KV pool stays released)."""
        self.close()
        self.engine.resume_weights()

    def alloc_kv(self) -> dict:
        """The KV pool back, sized from the device's free memory now (after the trainer's
        offload); returns that sizing (`rollout.build.KVSizing`, as a dict)."""
        self.close()
        return self.engine.alloc_kv()._asdict()

    # ------------------------------------------------------------------- weights (the receiver)
    def load_bucket(self, handle, manifest, own_shards: bool = False, in_place: bool = False):
        """A bucket of full tensors (rank 0 passes them to its followers), or with `own_shards`
        this TP rank's own shards (the resharding sync delivers to every rank)."""
        return self.weights.load_bucket(handle, manifest, own_shards, in_place)

    @ray.method(concurrency_group="weights")
    def receive_stream(
        self, address, own_shards: bool = False, timeout_s: float = 600.0, in_place: bool = False
    ) -> dict:
        """Every bucket of one colocated sync from a trainer rank on this host, handed over on
        its socket (`weight_sync.BucketStream`) instead of a call per bucket; as `load_bucket`
        otherwise. Returns the receiver's report.

        Its own group, with a thread per call: each streaming trainer rank starts one call on
        every engine it feeds and waits for all of them to connect, while its export's
        collectives (TP all-gathers, the vocabulary exchange) wait for the other ranks. Taken
        one at a time, an engine serving rank 0's stream would hold rank 1's call back while
        another engine served rank 1's and held rank 0's: each rank waiting for the engine the
        other holds. Run at once, every rank's stream is served as it arrives; their buckets
        load one at a time (`BucketReceiver`), and the commit (default group) comes only after
        every rank's push, which waits for these calls, returned."""
        return self.weights.receive_stream(address, own_shards, timeout_s, in_place)

    def load_bucket_bytes(
        self, buffer: torch.Tensor, manifest, own_shards: bool = False, in_place: bool = False
    ):
        """A bucket from a sender on another node: its bytes, not a shared-memory handle."""
        return self.weights.load_bucket_bytes(buffer, manifest, own_shards, in_place)

    def commit(self, in_place: bool = False) -> int:
        return self.weights.commit(in_place)

    def join_sync_group(
        self,
        host: str,
        port: int,
        rank: int,
        num_engines: int,
        num_stages: int,
        timeout_s: float,
        own_shards: bool = False,
    ) -> None:
        self.weights.join_sync_group(
            host, port, rank, num_engines, num_stages, timeout_s, own_shards
        )

    def receive_broadcast(self, in_place: bool = False) -> int:
        return self.weights.receive_broadcast(in_place)

    def flush_prefix_cache(self) -> None:
        self.close()
        self.engine.flush_prefix_cache()

    def set_weight_version(self, version: int) -> None:
        """Resume: the engine was built from a checkpoint holding weights of this version."""
        self.close()
        self.engine.weight_version = version

    def shutdown(self) -> None:
        """Stop the HTTP endpoint and the step loop (rank 0 of a TP replica also stops its
        followers' `follow`)."""
        if self.engine is None:
            return  # a follower: its rank 0 stops it
        if self._server is not None:
            self._server.stop()
            self._server = None
        self.async_engine.close()
        self.engine.close()
        self.handoff_sender.release_all()
        self.handoff_receiver.close()

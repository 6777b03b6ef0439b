"""The two Ray actors the controller drives: a trainer rank and an engine replica.

`TrainerWorker` is one rank of the trainer's torch.distributed world (gloo on CPU, NCCL on GPU):
every rank gets every call, because the trainer's methods contain collectives. It holds the
policy (and, for PPO, the critic) and pushes weights to the engines. `EngineWorker` holds one
rollout `Engine` and receives weights. Both are thin: the logic lives in `trainer/`, `rollout/`
and `weight_sync/`; here is only what must run inside the actor processes.

Weight sync sources: the TP-rank-0 / DP-rank-0 process of every pipeline stage streams its
stage's `export_hf_weights()`; the other ranks drain the same generator (its TP all-gathers need
them). Colocated, each bucket goes to every engine through shared memory (handles + manifests
travel as Ray calls; the returned ObjectRefs are the acknowledgements that free the buffer).
Disaggregated, sources and engines form a standalone process group and the sources broadcast.
"""

from __future__ import annotations

import dataclasses
import os
import time
import warnings
from collections.abc import Callable, Sequence
from contextlib import contextmanager
from typing import NamedTuple

import ray
import torch

from trainer.tensor_lists import PackedTensors, pack


def _set_threads(threads: int) -> None:
    torch.set_num_threads(max(1, threads))


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


_HELD_STORES: dict[int, object] = {}  # port -> the TCPStore master listening on it
WORLD_TIMEOUT_S = 1800.0  # the trainer world's collectives (torch.distributed's default)


def held_rendezvous() -> tuple[str, int]:
    """Where a group whose rank 0 is this process meets: an address of this node (chosen here,
    never on the controller's, which may be another machine) and a port that is never let go:
    a TCPStore master listens on it from the moment it is chosen until rank 0 takes it
    (`take_held_store`). A port probed free and closed again can be taken by any other process
    before the group binds it (seen: EADDRINUSE when a replica's TP group started)."""
    from datetime import timedelta

    import torch.distributed as dist

    host = ray.util.get_node_ip_address()
    store = dist.TCPStore(
        host, 0, is_master=True, wait_for_workers=False, timeout=timedelta(minutes=30)
    )
    _HELD_STORES[store.port] = store
    return host, store.port


def take_held_store(port: int, timeout_s: float):
    """Rank 0 of a group met at `held_rendezvous()`'s port: the store listening there."""
    from datetime import timedelta

    store = _HELD_STORES.pop(port)
    store.set_timeout(timedelta(seconds=timeout_s))
    return store


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


class _AllAcked:
    """A bucket delivered to several engines is free once every engine has acknowledged it
    (within `timeout_s`: a dead or hung engine fails the push instead of hanging it)."""

    def __init__(self, refs, timeout_s: float):
        self.refs, self.timeout_s = refs, timeout_s

    def result(self):
        return ray.get(self.refs, timeout=self.timeout_s)[0]


@ray.remote
class TrainerWorker:
    def __init__(self, rank: int, world_size: int, threads: int):
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK="0")
        use_node_interface()
        if torch.cuda.is_available():
            # Ray sets CUDA_VISIBLE_DEVICES to this actor's device: it is device 0 here.
            torch.cuda.set_device(0)
        _set_threads(threads)
        # megatron-core warns at import that Transformer Engine / Apex are absent; we use its
        # local specs on purpose (docs/trainer.md), so those lines are noise in every run.
        warnings.filterwarnings("ignore", category=UserWarning, module=r"megatron\.")
        self.rank = rank
        self.policy = None
        self.critic = None
        self._world_store = None  # where the world meets (`set_rendezvous`), until `build`
        self._busy: list[tuple[float, float]] = []  # compute intervals, time.time() (busy.py)

    def build(
        self,
        policy_cfg,
        critic_cfg=None,
        value_clip: float | None = None,
        off_policy: bool = False,
        sampling_path: str | None = None,
    ) -> int:
        """Load the policy (and critic) from `policy_cfg.model_path`. Returns the vocab size.
        `off_policy`: the engines sample each batch with the weights of the step before (keep a
        copy of those to tell the precision mismatch from the policy lag); `sampling_path`: a
        resumed run's engine-side weights, what its pending rollout is sampled with."""
        from trainer import make_trainer
        from trainer.megatron_import import import_megatron_core

        import_megatron_core()  # before trainer.parallel imports it
        from trainer.parallel import init_distributed

        init_distributed(self._world_store)  # the world, before the trainer asks for it
        self._world_store = None
        self.policy = make_trainer(policy_cfg)
        self.off_policy = off_policy
        if off_policy and sampling_path is not None:
            self.policy.keep_sampling_weights(sampling_path)
        if critic_cfg is not None:
            from trainer.critic import MegatronCritic

            self.critic = MegatronCritic(critic_cfg, value_clip=value_clip)
        return self.policy.vocab_size

    def ready(self) -> bool:
        return True

    def pin_cpus(self, cpus: list[int]) -> dict[int, list[int]]:
        """cluster.pin_cpus (`placement.pin`): this process's threads onto `cpus`."""
        return pin_process(cpus)

    def rendezvous(self) -> tuple[str, int]:
        """Rank 0: where the trainer world meets (this node's address, a port it holds)."""
        return held_rendezvous()

    def set_rendezvous(self, host: str, port: int) -> None:
        """Every rank, before `build` creates the world: rank 0's `rendezvous()`."""
        from datetime import timedelta

        import torch.distributed as dist

        os.environ.update(MASTER_ADDR=host, MASTER_PORT=str(port))
        self._world_store = (
            take_held_store(port, WORLD_TIMEOUT_S)  # rank 0 chose the port and holds it
            if self.rank == 0
            else dist.TCPStore(host, port, timeout=timedelta(seconds=WORLD_TIMEOUT_S))
        )

    def node_id(self) -> str:
        return node_id()

    # ------------------------------------------------------------------------------- training
    @contextmanager
    def _computing(self):
        start = time.time()
        try:
            yield
        finally:  # the results were read back (floats, CPU tensors): the device work is done
            self._busy.append((start, time.time()))

    def take_activity(self) -> list[tuple[float, float]]:
        """The compute intervals since the last call (`miles_like.run.busy`)."""
        out, self._busy = self._busy, []
        return out

    def train(self, batch, updates: int) -> dict[str, float]:
        with self._computing():
            return self._train(batch, updates)

    def _train(self, batch, updates: int) -> dict[str, float]:
        """The policy's part of one RL step: `updates` optimizer steps on consecutive
        mini-batches (`trainer.rl_updates.train_policy`)."""
        from trainer.rl_updates import train_policy

        return train_policy(
            self.policy, batch, _mini_batches(len(batch.tokens), updates), self.off_policy
        )

    # per-sample tensors go back as one flat tensor (`trainer.tensor_lists`: cheap to pickle)
    def ref_logprobs(self, batch) -> PackedTensors:
        with self._computing():
            return pack([t.cpu() for t in self.policy.compute_ref_logprobs(batch)])

    def values(self, batch) -> PackedTensors:
        with self._computing():
            return pack([t.cpu() for t in self.critic.compute_values(batch)])

    def train_critic(self, batch, updates: int) -> dict[str, float]:
        with self._computing():
            return self._train_critic(batch, updates)

    def _train_critic(self, batch, updates: int) -> dict[str, float]:
        from trainer.critic import explained_variance

        batch = dataclasses.replace(batch, old_values=self.critic.compute_values(batch))
        per_update = [
            self.critic.train_step(batch.subset(idx))
            for idx in _mini_batches(len(batch.tokens), updates)
        ]
        metrics = {k: sum(m[k] for m in per_update) / len(per_update) for k in per_update[0]}
        # of the values the advantages were computed from, on samples not yet trained on
        metrics["explained_var"] = explained_variance(
            batch.old_values, batch.returns, batch.loss_masks
        )
        return metrics

    def offload(self) -> int:
        return self.policy.offload() + (self.critic.offload() if self.critic else 0)

    def onload(self) -> int:
        return self.policy.onload() + (self.critic.onload() if self.critic else 0)

    # ----------------------------------------------------------------------------- weight sync
    def sync_role(self) -> tuple[bool, int]:
        """(is this rank a sync source, its pipeline stage)."""
        from megatron.core import parallel_state as ps

        if self.policy.cfg.backend == "megatron":
            source = ps.get_tensor_model_parallel_rank() == 0 and ps.get_data_parallel_rank() == 0
            return source, ps.get_pipeline_model_parallel_rank()
        return self.rank == 0, 0  # deepspeed: every rank can export the whole model

    def push_colocated(
        self, engines: Sequence, engine_nodes: Sequence[str], bucket_bytes: int, timeout_s: float
    ) -> dict[str, float]:
        """Stream this rank's export into every engine of `engines`: through shared memory to
        those on this node, as bytes in Ray's object store to those on other nodes (`engine_nodes`
        are their node ids; shared memory and CUDA IPC do not cross machines). Returns the
        sender's report (zero bytes on ranks that only take part in the gathers). The sender, and
        so its two shared buffers, lives across steps: mapping fresh shared memory every step
        would cost more than the copy. It delivers to this call's engines (an engine may have
        been replaced since the last one)."""
        source, _ = self.sync_role()
        if not source:
            for _ in self.policy.export_hf_weights():
                pass
            return {"bytes": 0.0}
        return self._push(
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
            for _ in shards:
                pass
            return {"bytes": 0.0}
        r = ps.get_tensor_model_parallel_rank()
        targets = [ranks[r] for ranks in replicas]
        nodes = [n[r] for n in replica_nodes]
        return self._push(shards, targets, nodes, True, timeout_s, bucket_bytes)

    def _push(self, stream, engines, engine_nodes, own_shards: bool, timeout_s, bucket_bytes):
        from weight_sync import ColocatedSender

        here = node_id()
        self._push_to = (
            [e for e, n in zip(engines, engine_nodes, strict=True) if n == here],
            [e for e, n in zip(engines, engine_nodes, strict=True) if n != here],
            timeout_s,
            own_shards,
        )
        if getattr(self, "_sender", None) is None:
            self._sender = ColocatedSender(
                self._deliver, bucket_bytes=bucket_bytes, device=_device()
            )
        report = self._sender.send(stream)
        remote = len(self._push_to[1])
        return {
            "bytes": float(report.nbytes),
            "buckets": float(report.num_buckets),
            "remote_bytes": float(report.nbytes * remote / max(1, len(engines))),
        }

    def _deliver(self, handle, manifest) -> _AllAcked:
        local, remote, timeout_s, own = self._push_to
        refs = [e.load_bucket.remote(handle, manifest, own) for e in local]
        if remote:  # one copy into the object store, fetched by each remote node
            data = ray.put(self._sender.allocator.buffer(handle).cpu().clone())
            refs += [e.load_bucket_bytes.remote(data, manifest, own) for e in remote]
        return _AllAcked(refs, timeout_s)

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
            source, stage = self.sync_role()
        if source:
            self.sync_group = SyncGroup.create(
                host,
                port,
                rank=num_engines + stage,
                size=num_engines + num_stages,
                backend=_backend(),
                timeout_s=timeout_s,
            )
            self.sync_sources = list(range(num_engines, num_engines + num_stages))
        return source

    def push_broadcast(self, bucket_bytes: int) -> dict[str, float]:
        """Broadcast this stage's export over the sync group (see `join_sync_group`)."""
        from weight_sync import BroadcastSender

        if self.sharded_broadcast:  # every trainer TP rank of DP rank 0 feeds its shard group
            stream = self.policy.export_engine_shards()
            source = getattr(self, "sync_group", None) is not None
        else:
            stream = self.policy.export_hf_weights()
            source = self.sync_role()[0]
        if not source:
            for _ in stream:
                pass
            return {"bytes": 0.0}
        report = BroadcastSender(
            self.sync_group, self.sync_sources, bucket_bytes=bucket_bytes
        ).send(stream)
        return {"bytes": float(report.nbytes), "buckets": float(report.num_buckets)}

    def save_hf(self, directory: str) -> None:
        """Write the policy as a Hugging Face checkpoint (rank 0 writes; all ranks gather)."""
        from safetensors.torch import save_file

        state = self.policy.hf_state_dict()
        if self.rank == 0:
            os.makedirs(directory, exist_ok=True)
            save_file(
                {k: v.detach().cpu().contiguous() for k, v in state.items()},
                os.path.join(directory, "model.safetensors"),
            )

    def save_state(self, path: str) -> None:
        """This rank's training state (optimizer, schedule, critic, RNG states): see
        `checkpoint.py`. Every rank writes its own file."""
        from miles_like.run import rng_state

        state = {"policy": self.policy.train_state(), "rng": rng_state.capture()}
        if self.critic is not None:
            state["critic"] = self.critic.train_state()
        os.makedirs(os.path.dirname(path), exist_ok=True)
        torch.save(state, path)

    def load_state(self, path: str) -> None:
        """Inverse of `save_state`, after `build` from the checkpoint's weights."""
        from miles_like.run import rng_state

        state = torch.load(path, map_location="cpu", weights_only=True)
        self.policy.load_train_state(state["policy"])
        if (self.critic is None) != ("critic" not in state):
            raise ValueError(f"{path}: the checkpoint {'lacks' if self.critic else 'has'} a critic")
        if self.critic is not None:
            self.critic.load_train_state(state["critic"])
        rng_state.restore(state["rng"])

    def shutdown(self) -> None:
        if getattr(self, "_sender", None) is not None:
            self._sender.close()
        from trainer.parallel import destroy_parallel

        destroy_parallel()


class _OwnShards(NamedTuple):
    """The receiver side of one TP rank's own shards (a `weight_sync` WeightReceiver): they are
    loaded on this rank only; rank 0's commit completes the replica's update."""

    load_weights: Callable
    commit_weights: Callable


class _EngineLoader:
    """What the weight receivers load full tensors into: the engine, either idle (the default)
    or, while `keep_running` (an in-place update), with its requests kept between two steps."""

    def __init__(self, engine):
        self.engine = engine
        self.keep_running = False

    def load_weights(self, named_tensors) -> None:
        self.engine.load_weights(named_tensors, keep_running=self.keep_running)

    def commit_weights(self) -> None:
        self.engine.commit_weights()


def _no_commit() -> None:
    """Followers hold no prefix cache and no version: rank 0 commits for the replica."""


def _mini_batches(n: int, updates: int) -> list[list[int]]:
    """`updates` consecutive, near-equal slices of range(n) (the first ones one larger)."""
    if not 1 <= updates <= n:
        raise ValueError(
            f"trainer.updates_per_rollout={updates} needs at least that many "
            f"samples per step; the batch has {n}"
        )
    size, extra = divmod(n, updates)
    out, start = [], 0
    for u in range(updates):
        end = start + size + (u < extra)
        out.append(list(range(start, end)))
        start = end
    return out


def _device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


CLOSED = "closed"  # generate_wave: the window was closed, no request was admitted


def _backend() -> str:
    return "nccl" if torch.cuda.is_available() else "gloo"


@ray.remote(concurrency_groups={"serve": 512, "tp": 1, "activity": 1})
class EngineWorker:
    """One engine replica behind an `AsyncEngine` (its step loop is the only thread that runs the
    engine's requests). The rollout window: `open()` admits requests (`generate_one`, the HTTP
    endpoint of `serve`), `close()` stops admitting and waits for what is in flight. Lifecycle
    calls (`release`, `resume`, `load_bucket`, `commit`, broadcasts, flushes) close the window
    themselves first, so no request is ever served by half-updated weights. The batch `generate`
    works either way (closed, it opens the window for its own duration).

    Ray runs `generate_one` in its own concurrency group, so many concurrent calls are batched
    together by the engine; every other method is in the default group, one at a time."""

    def __init__(self, engine_cfg, threads: int, tp_rank: int = 0):
        use_node_interface()
        if torch.cuda.is_available():
            torch.cuda.set_device(0)
        _set_threads(threads)
        self.cfg, self.tp_rank = engine_cfg, tp_rank
        self.on_gpu = engine_cfg.device.startswith("cuda")
        self.model_path = engine_cfg.model_path
        self._server = None
        self._waves: dict[int, list] = {}  # generate_wave's futures by wave, while it runs
        self.engine = self.follower = None
        if engine_cfg.tp == 1:
            self._build_engine()

    def _build_engine(self) -> None:
        from rollout import Engine
        from rollout.activity import ActivityLog
        from rollout.async_engine import AsyncEngine
        from weight_sync import BucketReceiver

        self.engine = Engine(self.cfg)
        self.engine.activity = ActivityLog()  # drained every step (take_activity)
        self.async_engine = AsyncEngine(self.engine, open=False)
        self.loader = _EngineLoader(self.engine)
        self.receiver = BucketReceiver(self.loader)
        # the resharding sync: this rank's own shards, loaded here only
        self.shard_receiver = BucketReceiver(
            _OwnShards(
                lambda tensors: self.engine.load_weights(tensors, all_ranks=False),
                self.engine.commit_weights,
            )
        )

    def ready(self) -> bool:
        return True

    def pin_cpus(self, cpus: list[int]) -> dict[int, list[int]]:
        """cluster.pin_cpus (`placement.pin`): this process's threads onto `cpus`."""
        return pin_process(cpus)

    # --------------------------------------------------------------- tensor-parallel replicas
    # A replica of k = `rollout.tp` ranks is k EngineWorkers, one per device. Rank 0 is the
    # replica everywhere else (scheduler, AsyncEngine, HTTP endpoint, every lifecycle call); the
    # others replay its commands (`rollout.tp_follower`) and take part only in the resharding
    # sync (`load_bucket(own_shards=True)`). A replica lives and dies whole: a follower whose
    # rank 0 is gone exits, and rank 0 exits when a follower dies (`watch_followers`), so the
    # controller sees an actor death and replaces every rank (`Runtime.restart_engine`).
    def start_tp(self, host: str, port: int, timeout_s: float) -> None:
        """Every rank of the replica at once: join its process group (which meets on rank 0's
        node, `rendezvous`), then build this rank: the Engine on rank 0, a follower elsewhere
        (`follow` then serves it). Collectives fail after `timeout_s`."""
        import datetime

        import torch.distributed as dist

        store = (
            take_held_store(port, timeout_s)
            if self.tp_rank == 0  # it chose the port (`rendezvous`) and holds it
            else dist.TCPStore(host, port, timeout=datetime.timedelta(seconds=timeout_s))
        )
        dist.init_process_group(
            _backend(),
            store=store,
            rank=self.tp_rank,
            world_size=self.cfg.tp,
            timeout=datetime.timedelta(seconds=timeout_s),
        )
        if self.tp_rank == 0:
            self._build_engine()
            return
        from rollout.tp_follower import EngineFollower
        from weight_sync import BucketReceiver

        self.follower = EngineFollower(self.cfg)
        self.shard_receiver = BucketReceiver(_OwnShards(self.follower.load_weights, _no_commit))

    @ray.method(concurrency_group="tp")
    def follow(self) -> None:
        """Followers: replay rank 0's commands until it stops the replica (`shutdown`). If
        rank 0 is lost the collective fails and this process exits."""
        try:
            self.follower.serve()
        except BaseException as e:  # noqa: BLE001 -- the replica is dead without its rank 0
            print(f"engine TP rank {self.tp_rank}: lost the replica ({e!r}); exiting", flush=True)
            os._exit(1)

    def watch_followers(self, follow_refs: list) -> None:
        """Rank 0: exit when a follower dies (its `follow` call fails), so that the replica
        is seen dead and replaced whole. Returns at once; a thread waits."""
        import threading

        def watch(ref) -> None:
            try:
                ray.get(ref)
            except Exception as e:  # noqa: BLE001 -- any failure of a rank kills the replica
                print(f"engine TP rank 0: a follower died ({e!r}); exiting", flush=True)
                os._exit(1)

        self._follow_refs = follow_refs
        for ref in follow_refs:
            threading.Thread(target=watch, args=(ref,), daemon=True).start()

    def _replica_intact(self, result: Callable):
        """`result()`; but when it fails on a TP replica because a rank is gone (its `follow`
        ended: the ranks are out of step for good), end this process, so that the controller
        sees the replica die and replaces it rather than reporting the error as the rollout's.
        (The watcher would end it too; this settles the race with the failed collective.)"""
        try:
            return result()
        except RuntimeError as e:
            refs = getattr(self, "_follow_refs", [])
            if refs and ray.wait(refs, num_returns=1, timeout=10.0)[0]:
                print(f"engine TP rank 0: a rank is gone ({e!r}); exiting", flush=True)
                os._exit(1)
            raise

    CACHE_COUNTERS = ("prefill_tokens_computed", "prefix_cache_hit_tokens")

    # ------------------------------------------------------------------------ the rollout window
    def open(self) -> None:
        """Admit requests (after the weights of this rollout are in)."""
        self.async_engine.resume()

    def close(self, abort_running: bool = False) -> None:
        """Stop admitting; returns once nothing is in flight (or all of it was aborted)."""
        self._end_in_place()  # a parked step loop would never drain
        self.async_engine.pause(abort_running=abort_running)

    # ------------------------------------------------------------------ in-place weight updates
    # `in_place=True` on `load_bucket` / `load_bucket_bytes` / `commit` / `receive_broadcast`:
    # requests in flight are kept, not drained (`rollout.partial: in_place`, async training). The
    # first such load parks the step loop between two forward passes (`AsyncEngine.hold`) and
    # the commit releases it, so no forward pass ever runs on half-updated weights; running
    # requests continue on their old K/V with the new weights. The window stays as it was.
    # Under engine TP only full tensors (rank 0 forwards them in step order), not own shards.
    def _begin_in_place(self, own_shards: bool) -> None:
        if own_shards:
            raise RuntimeError(
                "an in-place weight update under engine TP takes full tensors through rank 0; "
                "the resharding sync (own shards) needs an idle replica"
            )
        if not self.loader.keep_running:
            self.async_engine.hold()
            self.loader.keep_running = True

    def _end_in_place(self) -> None:
        if self.engine is not None and self.loader.keep_running:
            self.loader.keep_running = False
            self.async_engine.unhold()

    def is_open(self) -> bool:
        return self.async_engine.is_open

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
        was_open = self.async_engine.is_open
        self.async_engine.resume()
        try:
            before = self.engine.stats()
            # all at once: admitted together, as Engine.generate does (no timing in the batch)
            futures = self.async_engine.submit_many(list(zip(prompts, params)))
            results = [self._replica_intact(f.result) for f in futures]
            after = self.engine.stats()
        finally:
            if not was_open:
                self.async_engine.pause()
        # the window stays open for the whole call: no update can land between its requests
        return [r.samples for r in results], {
            **{k: after[k] - before[k] for k in self.CACHE_COUNTERS},
            "weight_version": results[0].weight_version if results else after["weight_version"],
        }

    @ray.method(num_returns="streaming")
    def generate_stream(
        self, prompts: list[list[int]], params: list, groups: list[int], quota: int | None
    ):
        """`generate` as a stream, for over-sampled rollouts: yields `(index, samples, weight
        version, per-sample token versions)` for each
        request as it finishes, then one dict: the counters of `generate` and `complete`, the
        groups (`groups[index]`) complete within `quota` in completion order (the rest of the
        batch was aborted once `quota` were: `AsyncEngine.submit_many`). The window is open
        for the whole call, so every sample of it has the one `weight_version` reported."""
        import concurrent.futures

        from rollout.async_engine import AsyncEngine

        was_open = self.async_engine.is_open
        self.async_engine.resume()
        try:
            before = self.engine.stats()
            futures = self.async_engine.submit_many(
                list(zip(prompts, params)), groups=groups, quota=quota
            )
            index = {id(f): i for i, f in enumerate(futures)}
            version = before["weight_version"]
            for f in concurrent.futures.as_completed(futures):
                result = f.result()
                version = result.weight_version
                yield index[id(f)], result.samples, version, result.sample_versions
            complete = AsyncEngine.complete_groups(futures).result() if futures else []
            after = self.engine.stats()
        finally:
            if not was_open:
                self.async_engine.pause()
        yield {
            **{k: after[k] - before[k] for k in self.CACHE_COUNTERS},
            "parked_reused_tokens": after["parked_reused_tokens"] - before["parked_reused_tokens"],
            "weight_version": version,
            "complete": complete,
        }

    @ray.method(num_returns="streaming", concurrency_group="serve")
    def generate_wave(self, prompts: list[list[int]], params: list, wave: int = 0):
        """The fully asynchronous producer's requests (`async_rollouts.py`): admitted together,
        in order (as `generate`), in the serve group, so lifecycle calls (`close(abort_running=
        True)`, the weight sync, `stats`, `cancel_wave`) run while they generate. Yields
        `(index, samples, weight version, per-sample token versions)` as each request finishes
        (aborted ones with the tokens they have); with the window closed it yields CLOSED once
        and nothing else (nothing ran). `wave` names the call for `cancel_wave`."""
        import concurrent.futures

        from rollout.async_engine import EngineUnavailable

        try:
            futures = self.async_engine.submit_many(list(zip(prompts, params)))
        except EngineUnavailable:
            yield CLOSED
            return
        self._waves[wave] = futures
        try:
            index = {id(f): i for i, f in enumerate(futures)}
            for f in concurrent.futures.as_completed(futures):
                result = self._replica_intact(f.result)
                yield index[id(f)], result.samples, result.weight_version, result.sample_versions
        finally:
            self._waves.pop(wave, None)

    @ray.method(concurrency_group="serve")
    def cancel_wave(self, wave: int, indices: list[int]) -> None:
        """Abort requests `indices` of `generate_wave(..., wave)` (those still running end now
        with the tokens they have; finished ones, or a wave that has ended, are left alone)."""
        futures = self._waves.get(wave, ())
        for k in indices:
            if k < len(futures):
                self.async_engine.cancel(futures[k])

    @ray.method(concurrency_group="serve")
    def generate_one(self, prompt_ids: list[int], params):
        """One request, batched with every other concurrent call (the window must be open:
        closed, it raises `EngineUnavailable`). Returns a `GenerationResult`."""
        return self._replica_intact(self.async_engine.submit(prompt_ids, params).result)

    def serve(self, host: str = "127.0.0.1", port: int = 0, model_name: str | None = None) -> str:
        """Start the OpenAI-compatible HTTP endpoint (`rollout.serving.server`) in a thread of this
        actor, on this replica's AsyncEngine (it answers 503 while the window is closed). Returns
        its base URL. The tokenizer comes from the model directory when it has one."""
        from rollout.serving.server import build_app, load_tokenizer, start_server

        if self._server is None:
            app = build_app(
                self.async_engine,
                load_tokenizer(self.model_path),
                model_name or os.path.basename(os.path.normpath(self.model_path)),
            )
            self._server = start_server(app, host, port)
        return self._server.url

    def stats(self) -> dict:
        return self.engine.stats()

    @ray.method(concurrency_group="activity")
    def take_activity(self) -> list:
        """The engine's forward passes since the last call (`rollout.activity.ForwardPass`); its
        own group, so it answers while a rollout's `generate` runs (off-policy steps)."""
        return self.engine.activity.take()

    def release(self) -> int:
        """Give the device to the trainer: the KV pool always; on GPU the weights too (the next
        sync refills every one of them)."""
        self.close()
        return self.engine.release_memory(weights=self.on_gpu)

    def resume(self) -> None:
        self.close()
        self.engine.resume_memory()

    def load_bucket(self, handle, manifest, own_shards: bool = False, in_place: bool = False):
        """A bucket of full tensors (rank 0 passes them to its followers), or with `own_shards`
        this TP rank's own shards (the resharding sync delivers to every rank). `in_place`:
        requests keep running (see above)."""
        self._before_load(own_shards, in_place)
        return self._receiver(own_shards).load(handle, manifest)

    def load_bucket_bytes(
        self, buffer: torch.Tensor, manifest, own_shards: bool = False, in_place: bool = False
    ):
        """A bucket from a sender on another node: its bytes, not a shared-memory handle."""
        self._before_load(own_shards, in_place)
        return self._receiver(own_shards).load_buffer(buffer, manifest)

    def _before_load(self, own_shards: bool, in_place: bool) -> None:
        if self.engine is None:
            return
        if in_place:
            self._begin_in_place(own_shards)
        else:
            self.close()

    def _receiver(self, own_shards: bool):
        if own_shards:
            return self.shard_receiver
        if self.engine is None:
            raise RuntimeError(
                f"engine TP rank {self.tp_rank} takes only its own shards; full tensors go to "
                "rank 0 (engine bug)"
            )
        return self.receiver

    def commit(self, in_place: bool = False) -> int:
        if not in_place:
            self.close()
            self.receiver.commit()
            return self.engine.weight_version
        self._begin_in_place(own_shards=False)  # a no-op after in-place loads
        try:
            self.receiver.commit()
        finally:
            self._end_in_place()
        return self.engine.weight_version

    def rendezvous(self) -> tuple[str, int]:
        """Rank 0 of the replica's TP group and of the broadcast group (engine 0, or replica
        0's rank r for the resharding sync's group r): they meet on this engine's node, at a
        port this process holds until the group starts."""
        return held_rendezvous()

    def node_id(self) -> str:
        return node_id()

    def weight_digests(self) -> dict[str, str]:
        """sha256 of every parameter's bytes, by HF name: to check a sync bitwise from outside."""
        import hashlib

        model = (self.engine or self.follower).model  # under TP: this rank's shards
        return {
            name: hashlib.sha256(
                p.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
            ).hexdigest()
            for name, p in model.named_parameters()
        }

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
        """Join the broadcast group as its `rank`: rank 0 of a replica taking full tensors for
        every rank, or (`own_shards`, the resharding sync) any rank taking its own shards in the
        group of its TP rank index."""
        from weight_sync import BroadcastReceiver, SyncGroup

        group = SyncGroup.create(
            host,
            port,
            rank=rank,
            size=num_engines + num_stages,
            backend=_backend(),
            timeout_s=timeout_s,
            # rank 0 chose the port (`rendezvous`) and holds it
            master_store=take_held_store(port, timeout_s) if rank == 0 else None,
        )
        self.broadcast_receiver = BroadcastReceiver(
            self.shard_receiver.engine if own_shards else self.loader,
            group,
            sources=list(range(num_engines, num_engines + num_stages)),
        )

    def flush_prefix_cache(self) -> None:
        self.close()
        self.engine.flush_prefix_cache()

    def set_weight_version(self, version: int) -> None:
        """Resume: the engine was built from a checkpoint holding weights of this version."""
        self.close()
        self.engine.weight_version = version

    def receive_broadcast(self, in_place: bool = False) -> int:
        """Every bucket of one broadcast, then the commit. `in_place`: requests keep running
        (the step loop stays parked for the whole receive, transfers included)."""
        if self.engine is None:  # a follower: its own shards; rank 0 commits for the replica
            self.broadcast_receiver.receive()
            return -1
        if not in_place:
            self.close()
            self.broadcast_receiver.receive()
            return self.engine.weight_version
        self._begin_in_place(own_shards=False)
        try:
            self.broadcast_receiver.receive()
        finally:
            self._end_in_place()
        return self.engine.weight_version

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

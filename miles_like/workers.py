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
import warnings
from collections.abc import Sequence

import ray
import torch


def _set_threads(threads: int) -> None:
    torch.set_num_threads(max(1, threads))


def node_rendezvous() -> tuple[str, int]:
    """An address of the node this process runs on and a port free there: where a group whose
    rank 0 lives in this process rendezvous. Chosen on that node, never on the controller's
    (which may be another machine)."""
    import socket

    host = ray.util.get_node_ip_address()
    with socket.socket() as s:
        s.bind((host, 0))
        return host, s.getsockname()[1]


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

    def rendezvous(self) -> tuple[str, int]:
        """Rank 0: where the trainer world meets (this node's address, a port free here)."""
        return node_rendezvous()

    def set_rendezvous(self, host: str, port: int) -> None:
        """Every rank, before `build` creates the world: rank 0's `rendezvous()`."""
        os.environ.update(MASTER_ADDR=host, MASTER_PORT=str(port))

    def node_id(self) -> str:
        return node_id()

    # ------------------------------------------------------------------------------- training
    def train(self, batch, updates: int) -> dict[str, float]:
        """The policy's part of one RL step: `updates` optimizer steps on consecutive
        mini-batches (`trainer.rl_updates.train_policy`)."""
        from trainer.rl_updates import train_policy

        return train_policy(
            self.policy, batch, _mini_batches(len(batch.tokens), updates), self.off_policy
        )

    def ref_logprobs(self, batch) -> list[torch.Tensor]:
        return [t.cpu() for t in self.policy.compute_ref_logprobs(batch)]

    def values(self, batch) -> list[torch.Tensor]:
        return [t.cpu() for t in self.critic.compute_values(batch)]

    def train_critic(self, batch, updates: int) -> dict[str, float]:
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
        from weight_sync import ColocatedSender

        source, _ = self.sync_role()
        if not source:
            for _ in self.policy.export_hf_weights():
                pass
            return {"bytes": 0.0}
        here = node_id()
        self._push_to = (
            [e for e, n in zip(engines, engine_nodes, strict=True) if n == here],
            [e for e, n in zip(engines, engine_nodes, strict=True) if n != here],
            timeout_s,
        )
        if getattr(self, "_sender", None) is None:
            self._sender = ColocatedSender(
                self._deliver, bucket_bytes=bucket_bytes, device=_device()
            )
        report = self._sender.send(self.policy.export_hf_weights())
        remote = len(self._push_to[1])
        return {
            "bytes": float(report.nbytes),
            "buckets": float(report.num_buckets),
            "remote_bytes": float(report.nbytes * remote / max(1, len(engines))),
        }

    def _deliver(self, handle, manifest) -> _AllAcked:
        local, remote, timeout_s = self._push_to
        refs = [e.load_bucket.remote(handle, manifest) for e in local]
        if remote:  # one copy into the object store, fetched by each remote node
            data = ray.put(self._sender.allocator.buffer(handle).cpu().clone())
            refs += [e.load_bucket_bytes.remote(data, manifest) for e in remote]
        return _AllAcked(refs, timeout_s)

    def join_sync_group(
        self, host: str, port: int, num_engines: int, num_stages: int, timeout_s: float
    ) -> bool:
        """Disaggregated: sources join the standalone sync group with the engines (engines are
        ranks 0..E-1, the source of stage s is rank E+s): at start, and again with every member
        when an engine was replaced. Its collectives fail after `timeout_s`. Returns whether
        this rank joined."""
        from weight_sync import SyncGroup

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

        source, _ = self.sync_role()
        if not source:
            for _ in self.policy.export_hf_weights():
                pass
            return {"bytes": 0.0}
        report = BroadcastSender(
            self.sync_group, self.sync_sources, bucket_bytes=bucket_bytes
        ).send(self.policy.export_hf_weights())
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
        from miles_like import rng_state

        state = {"policy": self.policy.train_state(), "rng": rng_state.capture()}
        if self.critic is not None:
            state["critic"] = self.critic.train_state()
        os.makedirs(os.path.dirname(path), exist_ok=True)
        torch.save(state, path)

    def load_state(self, path: str) -> None:
        """Inverse of `save_state`, after `build` from the checkpoint's weights."""
        from miles_like import rng_state

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


def _backend() -> str:
    return "nccl" if torch.cuda.is_available() else "gloo"


@ray.remote(concurrency_groups={"serve": 512})
class EngineWorker:
    """One engine replica behind an `AsyncEngine` (its step loop is the only thread that runs the
    engine's requests). The rollout window: `open()` admits requests (`generate_one`, the HTTP
    endpoint of `serve`), `close()` stops admitting and waits for what is in flight. Lifecycle
    calls (`release`, `resume`, `load_bucket`, `commit`, broadcasts, flushes) close the window
    themselves first, so no request is ever served by half-updated weights. The batch `generate`
    works either way (closed, it opens the window for its own duration).

    Ray runs `generate_one` in its own concurrency group, so many concurrent calls are batched
    together by the engine; every other method is in the default group, one at a time."""

    def __init__(self, engine_cfg, threads: int):
        from rollout import Engine
        from rollout.async_engine import AsyncEngine
        from weight_sync import BucketReceiver

        use_node_interface()
        if torch.cuda.is_available():
            torch.cuda.set_device(0)
        _set_threads(threads)
        self.engine = Engine(engine_cfg)
        self.async_engine = AsyncEngine(self.engine, open=False)
        self.receiver = BucketReceiver(self.engine)
        self.on_gpu = engine_cfg.device.startswith("cuda")
        self.model_path = engine_cfg.model_path
        self._server = None

    def ready(self) -> bool:
        return True

    CACHE_COUNTERS = ("prefill_tokens_computed", "prefix_cache_hit_tokens")

    # ------------------------------------------------------------------------ the rollout window
    def open(self) -> None:
        """Admit requests (after the weights of this rollout are in)."""
        self.async_engine.resume()

    def close(self, abort_running: bool = False) -> None:
        """Stop admitting; returns once nothing is in flight (or all of it was aborted)."""
        self.async_engine.pause(abort_running=abort_running)

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
            results = [f.result() for f in futures]
            after = self.engine.stats()
        finally:
            if not was_open:
                self.async_engine.pause()
        # the window stays open for the whole call: no update can land between its requests
        return [r.samples for r in results], {
            **{k: after[k] - before[k] for k in self.CACHE_COUNTERS},
            "weight_version": results[0].weight_version if results else after["weight_version"],
        }

    @ray.method(concurrency_group="serve")
    def generate_one(self, prompt_ids: list[int], params):
        """One request, batched with every other concurrent call (the window must be open:
        closed, it raises `EngineUnavailable`). Returns a `GenerationResult`."""
        return self.async_engine.submit(prompt_ids, params).result()

    def serve(self, host: str = "127.0.0.1", port: int = 0, model_name: str | None = None) -> str:
        """Start the OpenAI-compatible HTTP endpoint (`rollout.serve`) in a thread of this actor,
        on this replica's AsyncEngine (it answers 503 while the window is closed). Returns its
        base URL. The tokenizer comes from the model directory when it has one."""
        from rollout.serve import build_app, load_tokenizer, start_server

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

    def release(self) -> int:
        """Give the device to the trainer: the KV pool always; on GPU the weights too (the next
        sync refills every one of them)."""
        self.close()
        return self.engine.release_memory(weights=self.on_gpu)

    def resume(self) -> None:
        self.close()
        self.engine.resume_memory()

    def load_bucket(self, handle, manifest):
        self.close()
        return self.receiver.load(handle, manifest)

    def load_bucket_bytes(self, buffer: torch.Tensor, manifest):
        """A bucket from a sender on another node: its bytes, not a shared-memory handle."""
        return self.receiver.load_buffer(buffer, manifest)

    def commit(self) -> int:
        self.close()
        self.receiver.commit()
        return self.engine.weight_version

    def rendezvous(self) -> tuple[str, int]:
        """Engine 0 is rank 0 of the broadcast group: it meets on this engine's node."""
        return node_rendezvous()

    def node_id(self) -> str:
        return node_id()

    def weight_digests(self) -> dict[str, str]:
        """sha256 of every parameter's bytes, by HF name: to check a sync bitwise from outside."""
        import hashlib

        return {
            name: hashlib.sha256(
                p.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
            ).hexdigest()
            for name, p in self.engine.model.named_parameters()
        }

    def join_sync_group(
        self, host: str, port: int, rank: int, num_engines: int, num_stages: int, timeout_s: float
    ) -> None:
        from weight_sync import BroadcastReceiver, SyncGroup

        group = SyncGroup.create(
            host,
            port,
            rank=rank,
            size=num_engines + num_stages,
            backend=_backend(),
            timeout_s=timeout_s,
        )
        self.broadcast_receiver = BroadcastReceiver(
            self.engine, group, sources=list(range(num_engines, num_engines + num_stages))
        )

    def flush_prefix_cache(self) -> None:
        self.close()
        self.engine.flush_prefix_cache()

    def set_weight_version(self, version: int) -> None:
        """Resume: the engine was built from a checkpoint holding weights of this version."""
        self.close()
        self.engine.weight_version = version

    def receive_broadcast(self) -> int:
        self.close()
        self.broadcast_receiver.receive()
        return self.engine.weight_version

    def shutdown(self) -> None:
        """Stop the HTTP endpoint and the step loop."""
        if self._server is not None:
            self._server.stop()
            self._server = None
        self.async_engine.close()

"""One rank of the trainer as a Ray actor (`TrainerWorker`).

The ranks form one torch.distributed world (gloo on CPU, NCCL on GPU): every rank gets every
call, because the trainer's methods contain collectives. A rank holds the policy (and, for PPO,
the critic); its weight pushes are `TrainerWeightSender`'s. The logic lives in `trainer/` and
`weight_sync/`; here is only what must run inside the actor process.

A rank is *onloaded* (its weights and optimizer state on its device) except between `offload`
and `onload`: colocated on a GPU, the controller offloads it while the engines hold the device.
Every call that computes on the weights refuses to run offloaded (`OffloadedError`): on a GPU it
would compute on host copies, or fail deep inside a collective; on CPU, where moving memory does
nothing, the refusal is how a test sees a controller that asks too early. The offload comes in
two parts around the weight push: the optimizer state first, the weights after the push (which
refuses once they are offloaded).
"""

from __future__ import annotations

import dataclasses
import os
import time
import warnings
from collections.abc import Sequence
from contextlib import contextmanager

import ray
import torch

from miles_like.run.rendezvous import group_store, held_rendezvous, pin_process, start_actor_process
from miles_like.run.rendezvous import node_id as this_node_id
from miles_like.run.trainer_weight_sender import TrainerWeightSender
from miles_like.shares import near_equal_shares
from trainer.device_choice import device_for
from trainer.offload import OffloadPart
from trainer.tensor_lists import PackedTensors, pack

WORLD_TIMEOUT_S = 1800.0  # the trainer world's collectives (torch.distributed's default)


class OffloadedError(RuntimeError):
    """A call that computes on the weights reached a rank whose memory is offloaded."""


def mini_batches(n: int, updates: int) -> list[list[int]]:
    """`updates` consecutive, near-equal slices of range(n) (the first ones one larger)."""
    if not 1 <= updates <= n:
        raise ValueError(
            f"trainer.updates_per_rollout={updates} needs at least that many "
            f"samples per step; the batch has {n}"
        )
    return [list(share) for share in near_equal_shares(n, updates)]


def route_shares(n: int, updates: int, dp_size: int) -> list[list[int]]:
    """Per data-parallel rank, the samples of a batch of `n` whose routes it replays: its
    strided share (`trainer.megatron_runner.dp_share`, and the deepspeed backend's
    `trainer.deepspeed_trainer.dp_share`, the same split) of every mini-batch (`mini_batches`),
    which is all its forwards see, the scoring passes included."""
    out: list[list[int]] = [[] for _ in range(dp_size)]
    for mini in mini_batches(n, updates):
        for rank in range(dp_size):
            out[rank] += mini[rank::dp_size]
    return out


@ray.remote
class TrainerWorker:
    def __init__(self, rank: int, world_size: int, threads: int, accelerator: str):
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK="0")
        # the recipe's accelerator, not what this process sees (`trainer.device_choice`)
        self.device = device_for(accelerator)
        start_actor_process(threads, self.device)
        if self.device.type == "cuda":
            torch.cuda.set_device(0)  # the one GPU Ray made visible to this actor
        # megatron-core warns at import that Transformer Engine / Apex are absent; we use its
        # local specs on purpose (docs/trainer.md), so those lines are noise in every run.
        warnings.filterwarnings("ignore", category=UserWarning, module=r"megatron\.")
        self.rank = rank
        self.policy = None
        self.critic = None
        self.sender: TrainerWeightSender | None = None
        self.onloaded = True  # built on the device; `offload` / `onload` move it
        self.weights_offloaded = False  # `offload("weights")` too: no push until `onload`
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
        if self.sender is not None:  # a warm start's trainer is replaced by the run's
            self.sender.close()
        self.sender = TrainerWeightSender(self.policy, self.rank)
        self.onloaded = True
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
        os.environ.update(MASTER_ADDR=host, MASTER_PORT=str(port))
        self._world_store = group_store(self.rank, host, port, WORLD_TIMEOUT_S)

    def node_id(self) -> str:
        return this_node_id()

    # ------------------------------------------------------------------------------- memory
    def offload(self, part: OffloadPart = "all") -> int:
        """To host memory: "optimizer" (the policy's gradients, fp32 masters and optimizer
        state, and the whole critic: what the weight push does not read), "weights" (the policy's
        weights, after the push), or "all". Returns the bytes moved."""
        self.onloaded = False
        self.weights_offloaded |= part != "optimizer"
        if self.sender is not None and part != "optimizer":  # its device buckets go too
            self.sender.release()
        moved = self.policy.offload(part)
        if self.critic is not None and part != "weights":
            moved += self.critic.offload("all")
        return moved

    def onload(self) -> int:
        moved = self.policy.onload() + (self.critic.onload() if self.critic else 0)
        self.onloaded, self.weights_offloaded = True, False
        return moved

    # ------------------------------------------------------------------------------- training
    def _require_onloaded(self, what: str) -> None:
        if not self.onloaded:
            raise OffloadedError(
                f"trainer rank {self.rank}: {what} was asked while the rank is offloaded; "
                "the controller must onload the trainer first (controller bug)"
            )

    def _require_weights(self, what: str) -> None:
        """The weight push: the policy's weights must be on the device (its optimizer state may
        be offloaded already)."""
        if self.weights_offloaded:
            raise OffloadedError(
                f"trainer rank {self.rank}: {what} was asked while the rank's weights are "
                "offloaded; the controller must push before offloading them (controller bug)"
            )

    @contextmanager
    def _computing(self, what: str):
        """A call that computes on the weights: onloaded only, its interval recorded."""
        self._require_onloaded(what)
        start = time.time()
        try:
            yield
        finally:  # the results were read back (floats, CPU tensors): the device work is done
            self._busy.append((start, time.time()))

    def take_activity(self) -> list[tuple[float, float]]:
        """The compute intervals since the last call (`miles_like.run.busy`)."""
        out, self._busy = self._busy, []
        return out

    def data_parallel_place(self) -> tuple[int, int]:
        """(this rank's data-parallel rank, the data-parallel size), after `build`: megatron's
        data-parallel group, or on the deepspeed backend (no model parallelism, no megatron
        groups) the world, every rank of which trains its own share."""
        from megatron.core import parallel_state

        if not parallel_state.model_parallel_is_initialized():
            return torch.distributed.get_rank(), torch.distributed.get_world_size()
        return (
            parallel_state.get_data_parallel_rank(),
            parallel_state.get_data_parallel_world_size(),
        )

    def train(self, batch, updates: int, routes: list | None = None) -> dict[str, float]:
        """The policy's part of one RL step: `updates` optimizer steps on consecutive
        mini-batches (`trainer.rl_updates.train_policy`). `routes`: a mixture's routes to
        replay, per sample, given for this rank's samples only (`route_shares`; None
        elsewhere)."""
        from trainer.rl_updates import train_policy

        if routes is not None:
            batch = dataclasses.replace(batch, routed_experts=routes)
        with self._computing("train"):
            return train_policy(
                self.policy, batch, mini_batches(len(batch.tokens), updates), self.off_policy
            )

    # per-sample tensors go back as one flat tensor (`trainer.tensor_lists`: cheap to pickle)
    def ref_logprobs(self, batch) -> PackedTensors:
        with self._computing("ref_logprobs"):
            return pack([t.cpu() for t in self.policy.compute_ref_logprobs(batch)])

    def values(self, batch) -> PackedTensors:
        with self._computing("values"):
            return pack([t.cpu() for t in self.critic.compute_values(batch)])

    def train_critic(self, batch, updates: int) -> dict[str, float]:
        from trainer.critic import explained_variance

        with self._computing("train_critic"):
            batch = dataclasses.replace(batch, old_values=self.critic.compute_values(batch))
            per_update = [
                self.critic.train_step(batch.subset(idx))
                for idx in mini_batches(len(batch.tokens), updates)
            ]
            metrics = {k: sum(m[k] for m in per_update) / len(per_update) for k in per_update[0]}
            # of the values the advantages were computed from, on samples not yet trained on
            metrics["explained_var"] = explained_variance(
                batch.old_values, batch.returns, batch.loss_masks
            )
            return metrics

    # ---------------------------------------------------------------- weight push (the sender)
    def device_identity(self) -> tuple[str, str]:
        """(node, device) of this rank, for routing the colocated push (`weight_sync.identity`:
        the GPU's UUID, which names it in every process)."""
        from weight_sync import device_identity

        return device_identity(this_node_id(), self.device)

    def sync_place(self) -> tuple:
        """Where this rank sends from: `weight_push.SenderPlace` (identity, stage, TP rank)."""
        return (self.device_identity(), *self.sender.place())

    def push_colocated(
        self,
        shared: Sequence,
        as_bytes: Sequence,
        bucket_bytes: int,
        timeout_s: float,
        quantization: str | None = None,
    ) -> dict[str, float]:
        self._require_weights("push_colocated")
        return self.sender.push_colocated(shared, as_bytes, bucket_bytes, timeout_s, quantization)

    def push_colocated_shards(
        self,
        shared: Sequence,
        as_bytes: Sequence,
        bucket_bytes: int,
        timeout_s: float,
        quantization: str | None = None,
    ) -> dict[str, float]:
        self._require_weights("push_colocated_shards")
        return self.sender.push_colocated_shards(
            shared, as_bytes, bucket_bytes, timeout_s, quantization
        )

    def join_sync_group(
        self,
        host: str,
        port: int,
        num_engines: int,
        num_stages: int,
        timeout_s: float,
        shard_groups: Sequence[tuple[str, int]] | None = None,
    ) -> bool:
        return self.sender.join_sync_group(
            host, port, num_engines, num_stages, timeout_s, shard_groups
        )

    def push_broadcast(self, bucket_bytes: int) -> dict[str, float]:
        self._require_weights("push_broadcast")
        return self.sender.push_broadcast(bucket_bytes)

    # ---------------------------------------------------------------------------- checkpoints
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

        rng = rng_state.capture()
        if self.device.type == "cuda":  # this rank's own generator (the controller has none)
            rng["cuda"] = torch.cuda.get_rng_state()
        state = {"policy": self.policy.train_state(), "rng": rng}
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
        if self.device.type == "cuda" and "cuda" in state["rng"]:
            cuda = state["rng"]["cuda"]  # a list in checkpoints that saved every visible GPU's
            torch.cuda.set_rng_state(cuda[0] if isinstance(cuda, list) else cuda)

    def shutdown(self) -> None:
        if self.sender is not None:
            self.sender.close()
        from trainer.parallel import destroy_parallel

        destroy_parallel()

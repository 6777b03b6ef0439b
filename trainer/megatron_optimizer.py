"""The megatron backend's AdamW, held whole on every data-parallel rank or sharded over them.

Both update fp32 master weights (the parameters themselves for a float32 / float64 model) from
DDP's fp32 gradient buffers with torch's fused AdamW (no weight decay on norms and biases), and
round them into bf16 weights where the model computes in bf16. `MegatronModel.optimizer_step`
drives either the same way: `grad_norm()` (the global norm; one host read), then `discard()` on
a non-finite norm, else `step(lr, norm)` (clip by the norm, step, weights updated).

* `ReplicatedAdamW`: every DP rank holds every master and both moments, about 16 bytes per
  parameter beyond the weights (DDP all-reduces the gradients).
* `ShardedAdamW`: megatron-core's `DistributedOptimizer` (ZeRO-1): DDP reduce-scatters each
  gradient bucket so that DP rank r holds the reduced gradient of its 1 / DP of the buffer,
  rank r keeps the masters and moments of that shard only, steps it, and DDP all-gathers the
  updated weights. The same update as `ReplicatedAdamW` (tested: tests/trainer/
  test_distributed_optimizer.py), with 1 / DP of its optimizer memory. Megatron builds it for
  float32 / bf16 / fp16 parameters only (not float64). It runs on CPU too, over gloo
  (`cpu_compat` lets megatron build it there).

`select(cfg)` picks: `trainer.distributed_optimizer` true / false, or when null: sharded on
CUDA with more than one DP rank and a float32 / bf16 model.
"""

from __future__ import annotations

import torch
from megatron.core import parallel_state

from trainer.config import OptimConfig, TrainerConfig
from trainer.offload import OffloadPart, move_optimizer_state, move_params, tensors_bytes
from trainer.optim import clip_grads_, grad_norm, load_optimizer_state
from trainer.parallel import device


def select(cfg: TrainerConfig) -> bool:
    """Whether this trainer's optimizer state is sharded over DP (`ShardedAdamW`)."""
    if cfg.distributed_optimizer is not None:
        return cfg.distributed_optimizer
    return (
        device().type == "cuda"
        and parallel_state.get_data_parallel_world_size() > 1
        and cfg.dtype != "float64"
    )


def adamw(params: list[torch.Tensor], o: OptimConfig) -> torch.optim.AdamW:
    return torch.optim.AdamW(
        [
            {"params": [p for p in params if p.ndim >= 2], "weight_decay": o.weight_decay},
            # norms and biases: no weight decay
            {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
        ],
        lr=o.lr,
        betas=o.betas,
        eps=o.eps,
        # one fused kernel per parameter (CPU and GPU) instead of a chain of element-wise
        # passes each: the same update, rounded differently (tests: float64 bound 1e-10)
        fused=True,
    )


def _fp32_master(param: torch.nn.Parameter) -> torch.nn.Parameter:
    master = torch.nn.Parameter(param.detach().float().clone())
    # the grad norm needs to know which weights are TP shards / shared duplicates
    for attr in ("tensor_model_parallel", "partition_dim", "partition_stride", "shared"):
        if hasattr(param, attr):
            setattr(master, attr, getattr(param, attr))
    return master


def _set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr


class ReplicatedAdamW:
    sharded = False

    def __init__(self, params: list[torch.nn.Parameter], cfg: TrainerConfig):
        self.params = params
        # fp32 / fp64 params are their own master weights; bf16 params get fp32 master copies
        self.masters = params if cfg.dtype != "bfloat16" else [_fp32_master(p) for p in params]
        self.optimizer = adamw(self.masters, cfg.optim)
        self.max_norm = cfg.optim.grad_clip

    def grad_norm(self) -> float:
        for p, m in zip(self.params, self.masters):
            m.grad = p.main_grad  # DDP accumulated (and DP-reduced) fp32 grads
        return grad_norm(self.masters)

    def discard(self) -> None:
        for m in self.masters:
            m.grad = None

    def step(self, lr: float, norm: float) -> None:
        clip_grads_(self.masters, self.max_norm, norm)
        _set_lr(self.optimizer, lr)
        self.optimizer.step()
        with torch.no_grad():
            for p, m in zip(self.params, self.masters):
                if p is not m:
                    p.copy_(m)  # round the fp32 master to the model's dtype
                m.grad = None

    def state_dict(self) -> dict:
        state = {"optimizer": self.optimizer.state_dict()}
        if self.masters is not self.params:
            state["master"] = [m.detach().cpu() for m in self.masters]
        return state

    def load_state_dict(self, state: dict) -> None:
        if "sharding" in state:
            raise ValueError(
                "the checkpoint's optimizer state is sharded over data-parallel ranks; resume "
                "with trainer.distributed_optimizer: true and the same trainer layout"
            )
        with torch.no_grad():
            if "master" in state:
                for m, saved in zip(self.masters, state["master"], strict=True):
                    m.copy_(saved)
            elif self.masters is not self.params:
                raise ValueError("the checkpoint has no fp32 master weights for this bf16 model")
        load_optimizer_state(self.optimizer, state["optimizer"])

    def offload(self, part: OffloadPart = "all") -> int:
        """Params ("weights"), separate masters and Adam state ("optimizer") to the host;
        returns the bytes moved."""
        return self._move(torch.device("cpu"), part)

    def onload(self, device: torch.device) -> int:
        return self._move(device, "all")

    def _move(self, device: torch.device, part: OffloadPart) -> int:
        moved = move_params(self.params, device) if part != "optimizer" else 0
        if part != "weights":
            if self.masters is not self.params:
                moved += move_params(self.masters, device)
            moved += move_optimizer_state(self.optimizer, device)
        return moved


class ShardedAdamW:
    sharded = True

    def __init__(self, ddp, params: list[torch.nn.Parameter], cfg: TrainerConfig):
        from megatron.core.optimizer import OptimizerConfig
        from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

        o = cfg.optim
        config = OptimizerConfig(
            optimizer="adam",
            lr=o.lr,
            weight_decay=o.weight_decay,
            adam_beta1=o.betas[0],
            adam_beta2=o.betas[1],
            adam_eps=o.eps,
            clip_grad=0.0,  # clipped by our global norm (`step`)
            bf16=cfg.dtype == "bfloat16",
            params_dtype=cfg.torch_dtype,
            use_distributed_optimizer=True,
        )
        mp_group = parallel_state.get_model_parallel_group()
        self.params = params
        # megatron swaps the inner optimizer's params for this rank's shards of the masters
        self.optimizer = DistributedOptimizer(
            adamw(params, o),
            config,
            None,  # no loss scaling (bf16 / fp32)
            None,  # Adam's state is torch's own (created at the first step)
            model_chunks=[ddp],
            per_model_buffers={0: ddp.buffers},
            data_parallel_group=parallel_state.get_data_parallel_group(),
            data_parallel_group_gloo=None,  # used by megatron's own checkpoint format only
            data_parallel_group_idx=torch.distributed.get_rank(mp_group),
            distributed_optimizer_instance_id=0,
        )
        self.inner: torch.optim.AdamW = self.optimizer.optimizer
        self.masters = [m for group in self.inner.param_groups for m in group["params"]]
        self.buffers = ddp.buffers
        self.max_norm = o.grad_clip
        self.dp_size = parallel_state.get_data_parallel_world_size()
        self.dp_rank = parallel_state.get_data_parallel_rank()

    def grad_norm(self) -> float:
        self.optimizer.prepare_grads()  # the reduced grad shards onto the master shards
        return grad_norm(self.masters, data_parallel_shards=True)

    def discard(self) -> None:
        for m in self.masters:
            m.grad = None

    def step(self, lr: float, norm: float) -> None:
        clip_grads_(self.masters, self.max_norm, norm)
        _set_lr(self.inner, lr)
        # AdamW on the shards, masters rounded into the weights, weights all-gathered over DP
        self.optimizer.step_with_ready_grads()
        self.discard()

    def state_dict(self) -> dict:
        """This DP rank's shard: Adam state and masters (a float32 model's masters are its
        weights, which the checkpoint's weights restore)."""
        state = {
            "optimizer": self.inner.state_dict(),
            "sharding": [self.dp_size, self.dp_rank],
        }
        if self.optimizer.config.bf16:
            state["master"] = [m.detach().cpu() for m in self.masters]
        return state

    def load_state_dict(self, state: dict) -> None:
        here = [self.dp_size, self.dp_rank]
        if state.get("sharding") != here:
            saved = state.get("sharding", "not sharded")
            raise ValueError(
                f"the checkpoint's optimizer state (DP size, rank: {saved}) is not this rank's "
                f"shard ({here}); resume with the layout and trainer.distributed_optimizer "
                "the checkpoint was written with"
            )
        if self.optimizer.config.bf16:  # a bf16 model's weights are its masters' rounding
            with torch.no_grad():
                for m, saved in zip(self.masters, state["master"], strict=True):
                    m.copy_(saved)
        load_optimizer_state(self.inner, state["optimizer"])

    def offload(self, part: OffloadPart = "all") -> int:
        """Weights ("weights"), the separate master shards and the Adam state ("optimizer") to
        the host; returns the bytes moved. The weights live in DDP's param buffers (every
        parameter a view): each buffer is copied to the host and its storage freed, so every view
        stays valid for `onload`. That runs on a CPU device as well (a copy, freed and
        restored)."""
        moved = 0 if part == "weights" else self._move_masters(torch.device("cpu"))
        if part == "optimizer":
            return moved
        for buffer in self.buffers:
            if buffer.param_data_cpu is None:  # megatron would pin it, which needs CUDA
                data = buffer.param_data
                buffer.param_data_cpu = torch.empty(
                    data.shape, dtype=data.dtype, pin_memory=device().type == "cuda"
                )
            moved += tensors_bytes([buffer.param_data_cpu])
            buffer.offload_to_cpu(move_params=True, move_grads=False)
        return moved

    def onload(self, device: torch.device) -> int:
        moved = 0
        for buffer in self.buffers:
            moved += tensors_bytes([buffer.param_data])
            buffer.reload_from_cpu(move_params=True, move_grads=False)
        return moved + self._move_masters(device)

    def _move_masters(self, device: torch.device) -> int:
        moved = move_params(self.masters, device) if self.optimizer.config.bf16 else 0
        return moved + move_optimizer_state(self.inner, device)

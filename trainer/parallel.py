"""torch.distributed + megatron parallel state (TP x PP x DP) for one trainer process.

On CPU the backend is gloo, on GPU nccl: the device the launcher chose (`device_choice`). A
single process (tests, laptops) still gets a world of size 1, because megatron-core's parallel
layers always ask for their groups.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from trainer import cpu_compat, device_choice


def device() -> torch.device:
    """The device this trainer process computes on (`device_choice`: the launcher's choice, else
    its one CUDA device when CUDA is present, else the CPU)."""
    return device_choice.current()


def init_distributed(store: dist.Store | None = None) -> None:
    """torch.distributed from the environment (RANK, WORLD_SIZE, MASTER_ADDR / MASTER_PORT:
    torchrun, or `TrainerWorker.set_rendezvous`), or a 1-process world when launched plainly.

    `store`: where the world meets, rank 0's already listening on MASTER_PORT (the
    controller's `rendezvous.held_rendezvous`: the port was never let go between choosing it
    and this call, so nothing else can take it); every rank passes one (a store given
    explicitly is used without the prefix the environment's rendezvous adds, so the ranks
    cannot mix the two).
    The 1-process world meets in an in-process store, without a port and without touching
    os.environ, so subprocesses (torchrun, benchmarks) do not inherit a RANK / MASTER_PORT
    that belongs to this process."""
    if dist.is_initialized():
        return
    if device_choice.current().type == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    backend = device_choice.backend_for(device_choice.current())
    if store is not None:
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        dist.init_process_group(backend=backend, store=store, rank=rank, world_size=world)
    elif "RANK" in os.environ:
        dist.init_process_group(backend=backend)
    else:
        dist.init_process_group(backend=backend, store=dist.HashStore(), rank=0, world_size=1)


def init_parallel(tp: int = 1, pp: int = 1) -> None:
    """Initialize torch.distributed and megatron's model-parallel groups (`TrainerConfig.tp`,
    `TrainerConfig.pp`). DP size is world_size / (TP * PP)."""
    cpu_compat.apply()
    init_distributed()
    world = dist.get_world_size()
    if world % (tp * pp):
        raise ValueError(
            f"world size {world} is not divisible by TrainerConfig.tp x TrainerConfig.pp = "
            f"{tp} x {pp}"
        )
    if parallel_state.model_parallel_is_initialized():
        if (
            parallel_state.get_tensor_model_parallel_world_size() == tp
            and parallel_state.get_pipeline_model_parallel_world_size() == pp
        ):
            return
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        create_gloo_process_groups=device().type != "cuda",
    )
    # Seeds megatron's CUDA RNG tracker on GPU; on CPU the tracker is unused (no dropout).
    if device().type == "cuda":
        from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

        model_parallel_cuda_manual_seed(1234)


def destroy_parallel() -> None:
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()

"""The megatron trainer with its optimizer state held whole vs sharded over DP, in one world.

Run under torchrun (2 processes, gloo: DP = 2), as `test_distributed_optimizer.py` does:
`python -m torch.distributed.run --nproc_per_node 2 sharded_optimizer_run.py OUT.pt DIR DTYPE`.
On every rank: 3 steps with `trainer.distributed_optimizer: false` (torch AdamW on every rank),
3 with `true` (megatron's DistributedOptimizer, the trainer offloaded to the host and back
after each step, as the colocated loop does), and a third trainer resumed from the sharded
one's export + `train_state` after 2 steps, stepping once more. Rank 0 saves, per run, each
step's metrics and gathered weights, and each rank's optimizer elements.
"""

from __future__ import annotations

import dataclasses
import shutil
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import save_file

import collectives
from trainer import make_trainer
from trainer.config import OptimConfig

import scenarios

STEPS = 3
OPTIM = OptimConfig(
    lr=1e-3, eps=1e-3, grad_clip=1.0, weight_decay=0.01, lr_schedule="cosine", total_steps=5
)


def _optimizer_elements(trainer) -> int:
    return sum(m.numel() for m in trainer.policy.master)


def _steps(trainer, batch, n: int, cycle_memory: bool) -> list:
    out = []
    for _ in range(n):
        metrics = trainer.train_step(batch)
        if cycle_memory:
            trainer.offload()
            trainer.onload()
        out.append((metrics, trainer.hf_state_dict()))
    return out


def main(out: str, directory: str, dtype: str) -> None:
    base = scenarios.trainer_config(directory, dtype=dtype, optim=OPTIM)
    results: dict = {}
    for mode in ("off", "on"):  # trainer.distributed_optimizer false, true
        cfg = dataclasses.replace(base, distributed_optimizer=mode == "on")
        trainer = make_trainer(cfg)
        assert trainer.policy.optim.sharded == (mode == "on")
        batch = scenarios.fixed_batch(trainer.vocab_size)
        results[mode] = _steps(trainer, batch, STEPS - 1, cycle_memory=mode == "on")
        results[f"{mode}_elements"] = collectives.all_gather_object(_optimizer_elements(trainer))
        if mode == "on":  # checkpoint after 2 steps: HF weights + this rank's train_state
            ckpt = Path(out).parent / "ckpt"
            state_file = Path(out).parent / f"state{dist.get_rank()}.pt"
            torch.save(trainer.train_state(), state_file)  # as checkpoints are
            if dist.get_rank() == 0:
                ckpt.mkdir()
                weights = {k: v.contiguous() for k, v in trainer.hf_state_dict().items()}
                save_file(weights, str(ckpt / "model.safetensors"))
                shutil.copy(Path(directory) / "config.json", ckpt / "config.json")
            else:
                trainer.hf_state_dict()  # a collective: every rank takes part
            dist.barrier()
        results[mode] += _steps(trainer, batch, 1, cycle_memory=mode == "on")
        results["params"] = sum(p.numel() for p in trainer.policy.params)
    resumed = make_trainer(
        dataclasses.replace(base, model_path=str(ckpt), distributed_optimizer=True)
    )
    resumed.load_train_state(torch.load(state_file, weights_only=True))
    results["resumed"] = _steps(resumed, scenarios.fixed_batch(resumed.vocab_size), 1, False)
    # the sharded state refused by an optimizer holding the state whole
    whole = make_trainer(dataclasses.replace(base, model_path=str(ckpt)))
    try:
        whole.load_train_state(torch.load(state_file, weights_only=True))
    except ValueError as e:
        results["refused"] = str(e)
    if dist.get_rank() == 0:
        torch.save(results, out)
    from trainer.parallel import destroy_parallel

    destroy_parallel()


if __name__ == "__main__":
    main(*sys.argv[1:])

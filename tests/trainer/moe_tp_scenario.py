"""A mixture of experts in the megatron trainer at TP = 2 (2 gloo processes under torchrun), for
tests/trainer/test_megatron_moe_tp.py.

argv: OUT.pt, then a JSON object {case: HF directory}. Per case, every rank builds the float64
model from the checkpoint and runs the forward of `FORWARD_IDS` (logits gathered over the vocab
shards), the export (`gather_hf_state_dict`), then one PPO step of the policy trainer with the
load-balancing loss on (`trainer_config(..., dtype="float64", moe_aux_loss_coeff=AUX)`), its
metrics, its export after the step, and each TP rank's engine shards (`export_engine_shards`,
gathered to rank 0). Rank 0 saves {case: results}.
"""

from __future__ import annotations

import json
import sys

import torch

AUX = 0.01


def forward_ids(vocab_size: int) -> torch.Tensor:
    return torch.randint(0, vocab_size, (2, 13), generator=torch.Generator().manual_seed(3))


def run_case(directory: str) -> dict:
    import torch.distributed as dist
    from megatron.core import parallel_state

    from model_spec import ModelSpec
    from trainer.bridge import HFCheckpoint, gather_hf_state_dict, load_hf_weights
    from trainer.megatron_model import build_gpt_model
    from trainer.megatron_trainer import MegatronTrainer

    import scenarios

    arch = ModelSpec.from_dir(directory)
    model, layout = build_gpt_model(arch, params_dtype=torch.float64)
    load_hf_weights(model, arch, layout, HFCheckpoint(directory))
    model.eval()
    ids = forward_ids(arch.vocab_size)
    with torch.no_grad():
        local = model(ids, torch.arange(ids.shape[1]).expand_as(ids), None)
    group = parallel_state.get_tensor_model_parallel_group()
    shards = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
    dist.all_gather(shards, local.contiguous(), group=group)
    logits = torch.cat(shards, dim=-1)[..., : arch.vocab_size]
    exported = gather_hf_state_dict(model, arch, layout)

    cfg = scenarios.trainer_config(directory, tp=2, dtype="float64", moe_aux_loss_coeff=AUX)
    trainer = MegatronTrainer(cfg)
    metrics = trainer.train_step(scenarios.fixed_batch(arch.vocab_size))
    after = trainer.hf_state_dict()
    engine_shards = [None] * dist.get_world_size(group)
    mine = {name: t.clone() for name, t in trainer.export_engine_shards()}
    dist.all_gather_object(engine_shards, mine, group=group)
    return dict(
        logits=logits,
        exported=exported,
        metrics=metrics,
        after=after,
        engine_shards=engine_shards,
    )


def main(argv: list[str]) -> None:
    import torch.distributed as dist

    from trainer.parallel import destroy_parallel, init_parallel

    out, dirs = argv[0], json.loads(argv[1])
    init_parallel(2, 1)
    results = {case: run_case(directory) for case, directory in dirs.items()}
    if dist.get_rank() == 0:
        torch.save(results, out)
    destroy_parallel()


if __name__ == "__main__":
    main(sys.argv[1:])

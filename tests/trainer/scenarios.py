"""Trainer scenarios run identically in one process (TP=PP=DP=1) and under torchrun.

`run(model_dir, parallel)` builds a MegatronTrainer on a tiny HF checkpoint, and returns
(on every rank) the response log-probs of a fixed batch, the exported HF state dict, and the
state dict and metrics after one PPO optimizer step. Tests compare these to HF transformers
and across parallel layouts.

Run as a script under torchrun (repo root, tests/ and tests/trainer on PYTHONPATH):
`python -m torch.distributed.run --nproc_per_node 2 tests/trainer/scenarios.py OUT.pt PLAN`,
PLAN a JSON list of [layout, backend, tp, pp, [model dirs]] (see `main`).
"""

from __future__ import annotations

import sys

import torch

from trainer.config import LossConfig, OptimConfig, RLBatch, TrainerConfig


def fixed_batch(vocab_size: int) -> RLBatch:
    """Six samples of mixed lengths; samples 0 and 3 share their 3-token prompt (a GRPO
    group), so the megatron backend packs that prompt once (`trainer.share_prompts`)."""
    g = torch.Generator().manual_seed(1234)
    lengths, prompts = (9, 5, 12, 7, 10, 6), (3, 2, 6, 3, 1, 5)
    tokens = [torch.randint(0, vocab_size, (n,), generator=g).tolist() for n in lengths]
    tokens[3][:3] = tokens[0][:3]
    advantages = [torch.randn(n - p, generator=g) for n, p in zip(lengths, prompts)]
    return RLBatch(tokens=tokens, prompt_lens=list(prompts), advantages=advantages)


def trainer_config(model_dir: str, tp: int = 1, pp: int = 1, **kw) -> TrainerConfig:
    base = dict(
        model_path=str(model_dir),
        tp=tp,
        pp=pp,
        max_tokens_per_micro_batch=20,
        # eps well above the smallest grads keeps Adam's first step ~linear in the
        # grad, so layouts can be compared at 1e-5 while weights still move ~1e-3.
        optim=OptimConfig(lr=1e-3, eps=1e-3, grad_clip=1.0, weight_decay=0.01),
        loss=LossConfig(policy_loss="ppo", clip_low=0.2, clip_high=0.28, entropy_coef=0.01),
    )
    base.update(kw)
    return TrainerConfig(**base)


def run(model_dir: str, tp: int = 1, pp: int = 1, backend: str = "megatron") -> dict:
    """backend: megatron | deepspeed (ZeRO-2) | deepspeed-zero3."""
    from trainer import make_trainer

    extra = {"zero_stage": 3} if backend == "deepspeed-zero3" else {}
    backend = backend.split("-")[0]
    trainer = make_trainer(trainer_config(model_dir, tp, pp, backend=backend, **extra))
    batch = fixed_batch(trainer.vocab_size)
    logprobs, entropy = trainer.compute_logprobs(batch, with_entropy=True)
    exported = trainer.hf_state_dict()
    metrics = trainer.train_step(batch)
    after = trainer.hf_state_dict()
    return dict(logprobs=logprobs, entropy=entropy, exported=exported, metrics=metrics, after=after)


def main(argv: list[str]) -> None:
    """argv: OUT.pt, then a JSON list of [layout, backend, tp, pp, [model dirs]]; rank 0 saves
    {layout: {dir: results}}. All layouts run in this one world (2 processes), one after the
    other, re-initializing megatron's parallel state when TP / PP change."""
    import json

    import torch.distributed as dist

    out, plan = argv[0], json.loads(argv[1])
    results = {
        layout: {d: run(d, tp, pp, backend) for d in dirs} for layout, backend, tp, pp, dirs in plan
    }
    if dist.get_rank() == 0:
        torch.save(results, out)
    from trainer.parallel import destroy_parallel

    destroy_parallel()


if __name__ == "__main__":
    main(sys.argv[1:])

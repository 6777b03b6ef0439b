"""Training backends (megatron-core; DeepSpeed for plain HF models), RL losses, log-probs.

    from trainer import TrainerConfig, RLBatch, make_trainer
    trainer = make_trainer(TrainerConfig(model_path=DIR, backend="megatron"))
    metrics = trainer.train_step(RLBatch(tokens, prompt_lens, advantages=adv))
    for hf_name, tensor in trainer.export_hf_weights(): ...

Backends are imported lazily: importing `trainer` loads neither megatron nor deepspeed.
See docs/trainer.md for the design.
"""

from trainer.config import LossConfig, OptimConfig, RLBatch, TrainerConfig

__all__ = ["LossConfig", "OptimConfig", "RLBatch", "TrainerConfig", "make_trainer"]


def make_trainer(cfg: TrainerConfig):
    """The policy trainer for `cfg.backend` (every rank of the world calls this together)."""
    if cfg.backend == "megatron":
        from trainer.megatron_import import import_megatron_core

        import_megatron_core()
        from trainer.megatron_trainer import MegatronTrainer

        return MegatronTrainer(cfg)
    from trainer.deepspeed_trainer import DeepSpeedTrainer

    return DeepSpeedTrainer(cfg)

"""Training state for exact resume: a trainer rebuilt from its Hugging Face export plus its
`train_state()` (saved with `torch.save`, read back with `torch.load(weights_only=True)`, as
checkpoints are) continues exactly like the trainer that never stopped: same metrics, same
weights, bit for bit, through a warmup + cosine schedule, weight decay and Adam moments."""

from __future__ import annotations

import dataclasses
import shutil

import pytest
import torch
from safetensors.torch import save_file

from trainer import make_trainer
from trainer.config import OptimConfig

import scenarios

OPTIM = OptimConfig(
    lr=1e-3,
    eps=1e-3,
    grad_clip=1.0,
    weight_decay=0.01,
    lr_schedule="cosine",
    warmup_steps=1,
    total_steps=5,
)


def _reloaded(state, tmp_path):
    path = tmp_path / "state.pt"
    torch.save(state, path)
    return torch.load(path, weights_only=True)


def _export(trainer, src, dst):
    """The trainer's weights as a Hugging Face directory (what a checkpoint holds)."""
    dst.mkdir()
    save_file(
        {k: v.contiguous() for k, v in trainer.hf_state_dict().items()},
        str(dst / "model.safetensors"),
    )
    shutil.copy(src / "config.json", dst / "config.json")


@pytest.mark.parametrize(
    "backend,dtype", [("megatron", "float32"), ("megatron", "bfloat16"), ("deepspeed", "float32")]
)
def test_policy_trainer_resumes_exactly(backend, dtype, tiny_hf_checkpoints, tmp_path):
    hf_model, directory = tiny_hf_checkpoints("qwen2")
    cfg = scenarios.trainer_config(directory, backend=backend, dtype=dtype, optim=OPTIM)
    batch = scenarios.fixed_batch(hf_model.config.vocab_size)
    original = make_trainer(cfg)
    for _ in range(2):
        original.train_step(batch)
    _export(original, directory, tmp_path / "ckpt")
    state = _reloaded(original.train_state(), tmp_path)
    resumed = make_trainer(dataclasses.replace(cfg, model_path=str(tmp_path / "ckpt")))
    resumed.load_train_state(state)
    for _ in range(2):
        a, b = original.train_step(batch), resumed.train_step(batch)
        assert a == b and a["grad_norm"] > 0
    after_a, after_b = original.hf_state_dict(), resumed.hf_state_dict()
    assert all(torch.equal(after_a[k], after_b[k]) for k in after_a)


def test_critic_resumes_exactly(tiny_hf_checkpoints, tmp_path):
    """A critic has no Hugging Face form: its state carries its parameters too."""
    from trainer.critic import MegatronCritic

    hf_model, directory = tiny_hf_checkpoints("qwen2")
    cfg = scenarios.trainer_config(directory, optim=dataclasses.replace(OPTIM, lr=1e-2))
    batch = scenarios.fixed_batch(hf_model.config.vocab_size)
    batch = dataclasses.replace(
        batch, returns=[torch.linspace(-1.0, 1.0, len(a)) for a in batch.advantages]
    )
    original = MegatronCritic(cfg)
    for _ in range(2):
        original.train_step(batch)
    resumed = MegatronCritic(cfg)  # a fresh critic on the base weights, then the state
    resumed.load_train_state(_reloaded(original.train_state(), tmp_path))
    for _ in range(2):
        assert original.train_step(batch) == resumed.train_step(batch)
    values_a, values_b = original.compute_values(batch), resumed.compute_values(batch)
    assert all(torch.equal(a, b) for a, b in zip(values_a, values_b))

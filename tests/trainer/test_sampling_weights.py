"""The copy of the weights the engines sample with (off policy): after updates, the trainer
scores a batch under the kept weights exactly as it scored it before them, on both backends."""

from __future__ import annotations

import shutil

import pytest
import torch
from safetensors.torch import save_file

from trainer import make_trainer
from trainer.config import OptimConfig

import scenarios


@pytest.mark.parametrize("backend", ["megatron", "deepspeed"])
def test_kept_weights_score_as_before_the_update(backend, tiny_hf_checkpoints, tmp_path):
    hf_model, directory = tiny_hf_checkpoints("qwen2")
    trainer = make_trainer(
        scenarios.trainer_config(directory, backend=backend, optim=OptimConfig(lr=1e-2))
    )
    batch = scenarios.fixed_batch(hf_model.config.vocab_size)
    with pytest.raises(ValueError, match="keep_sampling_weights"):
        trainer.compute_sampling_logprobs(batch)
    before = trainer.compute_logprobs(batch)
    trainer.keep_sampling_weights()
    for _ in range(2):
        trainer.train_step(batch)
    now = trainer.compute_logprobs(batch)
    kept = trainer.compute_sampling_logprobs(batch)
    assert all(torch.equal(k, b) for k, b in zip(kept, before))  # bitwise
    assert max(float((n - b).abs().max()) for n, b in zip(now, before)) > 1e-3
    # a second copy follows the weights (the next batch's)
    trainer.keep_sampling_weights()
    assert all(torch.equal(k, n) for k, n in zip(trainer.compute_sampling_logprobs(batch), now))
    # a resumed run loads them from the checkpoint's HF directory instead: the same scores
    saved = tmp_path / "engine"
    saved.mkdir()
    shutil.copy(directory / "config.json", saved)
    save_file(
        {k: v.contiguous() for k, v in trainer.hf_state_dict().items()},
        str(saved / "model.safetensors"),
    )
    trainer.train_step(batch)
    trainer.keep_sampling_weights(str(saved))
    assert all(torch.equal(k, n) for k, n in zip(trainer.compute_sampling_logprobs(batch), now))

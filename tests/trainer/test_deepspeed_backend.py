"""DeepSpeed backend (ZeRO-2 and ZeRO-3, CPU, torch Adam): log-probs equal HF's, steps lower
the loss, and its first PPO step computes the same loss, gradient norm and weights as the
megatron backend; and on CPU it starts without JIT-compiling DeepSpeed's shared-memory comm op
(minutes of CPU on a fresh machine, for an inference all-reduce ZeRO training never calls)."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from trainer.config import LossConfig, OptimConfig

import scenarios
from trainer_helpers import FAMILIES, hf_response_logprobs, max_abs_diff


def _trainer(directory, **kw):
    from trainer.deepspeed_trainer import DeepSpeedTrainer

    return DeepSpeedTrainer(scenarios.trainer_config(directory, backend="deepspeed", **kw))


@pytest.mark.parametrize("family", FAMILIES)
def test_logprobs_equal_hf(family, tiny_hf_checkpoints):
    hf_model, directory = tiny_hf_checkpoints(family)
    trainer = _trainer(directory)
    batch = scenarios.fixed_batch(hf_model.config.vocab_size)
    lp, ent = trainer.compute_logprobs(batch, with_entropy=True)
    ref_lp, ref_ent = hf_response_logprobs(hf_model, batch.tokens, batch.prompt_lens)
    assert max_abs_diff(lp, ref_lp) <= 1e-5
    assert max_abs_diff(ent, ref_ent) <= 1e-5


def test_sft_steps_lower_the_loss(tiny_hf_checkpoints):
    hf_model, directory = tiny_hf_checkpoints("llama")
    trainer = _trainer(
        directory, loss=LossConfig(policy_loss="sft"), optim=OptimConfig(lr=3e-3, grad_clip=1.0)
    )
    batch = scenarios.fixed_batch(hf_model.config.vocab_size)
    losses = [trainer.train_step(batch)["loss"] for _ in range(4)]
    assert losses[-1] < losses[0] - 0.1, losses


def test_first_ppo_step_matches_megatron(tiny_hf_checkpoints, single_process_results):
    """Same checkpoint, batch, micro-batch budget and loss config as the megatron scenario:
    the objective and the global gradient norm must agree across backends, and the exported
    weights after the step must agree too."""
    hf_model, directory = tiny_hf_checkpoints("qwen3")
    trainer = _trainer(directory)
    batch = scenarios.fixed_batch(hf_model.config.vocab_size)
    metrics = trainer.train_step(batch)
    mega = single_process_results["qwen3"]
    assert metrics["ratio_max"] == 1.0 and metrics["clipfrac"] == 0.0
    assert metrics["loss"] == pytest.approx(mega["metrics"]["loss"], abs=1e-6)
    assert metrics["grad_norm"] == pytest.approx(mega["metrics"]["grad_norm"], rel=1e-5)
    after = trainer.hf_state_dict()
    assert sorted(after) == sorted(mega["after"])
    assert max(float((after[k] - mega["after"][k]).abs().max()) for k in after) <= 1e-5


def test_offload_onload_keeps_training(tiny_hf_checkpoints):
    hf_model, directory = tiny_hf_checkpoints("qwen2")
    trainer = _trainer(directory, zero_stage=2)
    batch = scenarios.fixed_batch(hf_model.config.vocab_size)
    trainer.train_step(batch)  # creates Adam state
    param_bytes = sum(v.numel() * v.element_size() for v in trainer.hf_state_dict().values())
    moved = trainer.offload()
    # fp32 master + model weights + two Adam moments
    assert moved == 4 * param_bytes
    assert trainer.onload() == moved
    before = trainer.hf_state_dict()
    assert trainer.train_step(batch)["grad_norm"] > 0
    after = trainer.hf_state_dict()
    assert any(not torch.equal(before[k], after[k]) for k in before)


def test_zero3_logprobs_and_first_step_match_megatron(tiny_hf_checkpoints, single_process_results):
    hf_model, directory = tiny_hf_checkpoints("qwen3")
    trainer = _trainer(directory, zero_stage=3)
    batch = scenarios.fixed_batch(hf_model.config.vocab_size)
    ref_lp, _ = hf_response_logprobs(hf_model, batch.tokens, batch.prompt_lens)
    assert max_abs_diff(trainer.compute_logprobs(batch), ref_lp) <= 1e-5
    metrics = trainer.train_step(batch)
    mega = single_process_results["qwen3"]
    assert metrics["grad_norm"] == pytest.approx(mega["metrics"]["grad_norm"], rel=1e-5)
    after = trainer.hf_state_dict()
    assert sorted(after) == sorted(mega["after"])
    assert max(float((after[k] - mega["after"][k]).abs().max()) for k in after) <= 1e-5
    with pytest.raises(NotImplementedError, match="zero_stage"):
        trainer.offload()
    # ZeRO-3 left torch's linear alone: by default it swaps in its own for the whole process,
    # and everything built after it (an engine, another model) computed through that
    assert torch.nn.functional.linear is torch._C._nn.linear


def test_first_step_kl_zero_with_reference_then_positive(tiny_hf_checkpoints):
    hf_model, directory = tiny_hf_checkpoints("qwen2")
    trainer = _trainer(
        directory,
        use_reference=True,
        reference_on_cpu=True,
        loss=LossConfig(policy_loss="ppo", kl_coef=0.1, kl_type="low-var-kl"),
    )
    batch = scenarios.fixed_batch(hf_model.config.vocab_size)
    ref = trainer.compute_ref_logprobs(batch)
    ref_lp, _ = hf_response_logprobs(hf_model, batch.tokens, batch.prompt_lens)
    assert max_abs_diff(ref, ref_lp) <= 1e-5
    first = trainer.train_step(batch)
    assert first["kl"] == 0.0 and first["ratio_max"] == 1.0
    assert trainer.train_step(batch)["kl"] > 0


def test_bf16_steps_lower_the_loss(tiny_hf_checkpoints):
    hf_model, directory = tiny_hf_checkpoints("llama")
    trainer = _trainer(
        directory,
        dtype="bfloat16",
        loss=LossConfig(policy_loss="sft"),
        optim=OptimConfig(lr=3e-3, grad_clip=1.0),
    )
    batch = scenarios.fixed_batch(hf_model.config.vocab_size)
    losses = [trainer.train_step(batch)["loss"] for _ in range(4)]
    assert losses[-1] < losses[0] - 0.1, losses


def test_a_cpu_trainer_compiles_no_deepspeed_op(tiny_hf_checkpoints, tmp_path):
    """In a fresh process with an empty torch extensions cache (where DeepSpeed JIT-builds its
    ops): a ZeRO-2 trainer is built and steps, and the cache is still empty."""
    _, directory = tiny_hf_checkpoints("qwen2")
    tests = Path(__file__).resolve().parents[1]
    code = (
        "import scenarios\n"
        "from trainer.deepspeed_trainer import DeepSpeedTrainer\n"
        f"cfg = scenarios.trainer_config({str(directory)!r}, backend='deepspeed')\n"
        "trainer = DeepSpeedTrainer(cfg)\n"
        "print(trainer.train_step(scenarios.fixed_batch(trainer.vocab_size))['loss'])\n"
    )
    extensions = tmp_path / "torch_extensions"
    path = os.pathsep.join(str(p) for p in (tests.parent, tests / "trainer", tests))
    proc = subprocess.run(
        [sys.executable, "-W", "ignore", "-c", code],
        cwd=tests.parent,
        env={**os.environ, "TORCH_EXTENSIONS_DIR": str(extensions), "PYTHONPATH": path},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert math.isfinite(float(proc.stdout.split()[-1]))  # the step ran
    assert not extensions.exists() or not any(extensions.iterdir())

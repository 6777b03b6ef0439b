"""`TrainerConfig.compile` (trainer/compiled.py) against the eager trainer it replaces.

Two megatron trainers on the same tiny checkpoint, eager and compiled, score and train the same
mixed-length batch (several packed micro-batches, so the compiled pieces see more than one
token count). The eager model is the reference: log-probs, entropy, loss and every parameter's
gradient agree within stated bounds (fused loops round differently, so not bitwise); the
compiled first update is still exactly on-policy (ratio 1, PPO-KL 0); and the compiled pieces
are really the ones that ran (every RMSNorm routed, dynamo graphs compiled, and a wrong
compiled rotation is caught by the same comparison).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

import scenarios
from trainer_helpers import max_abs_diff

# (log-probs / entropy absolute, gradient relative to its tensor's largest entry). Measured on
# this batch: float32 1.4e-6 / 1.2e-6, float64 2.7e-15 / 3.0e-15 (inductor keeps float64 in
# double), so a bound ~10x the rounding gap, far below what a wrong piece gives (last test).
BOUNDS = {"float32": (1e-5, 2e-5), "float64": (1e-13, 1e-13)}


def _grads(trainer) -> list[torch.Tensor]:
    # DDP's grad buffers still hold the step's gradient after the optimizer step
    return [p.main_grad.detach().clone() for p in trainer.policy.params]


def _run(directory, dtype: str, compile: bool):
    from trainer.megatron_trainer import MegatronTrainer

    trainer = MegatronTrainer(scenarios.trainer_config(directory, dtype=dtype, compile=compile))
    batch = scenarios.fixed_batch(trainer.vocab_size)
    lp, ent = trainer.compute_logprobs(batch, with_entropy=True)
    metrics = trainer.train_step(batch)
    return trainer, lp, ent, metrics, _grads(trainer)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_compiled_step_matches_eager(dtype, tiny_hf_checkpoints):
    from trainer import compiled, packed_rope

    _, directory = tiny_hf_checkpoints("qwen3")  # q/k-norms too: every kind of RMSNorm
    _, lp_e, ent_e, m_e, g_e = _run(directory, dtype, compile=False)
    graphs_before = compiled.compiled_graphs()
    trainer, lp_c, ent_c, m_c, g_c = _run(directory, dtype, compile=True)
    assert compiled.compiled_graphs() > graphs_before

    norms = [m for m in trainer.policy.raw.modules() if isinstance(m, torch.nn.RMSNorm)]
    assert norms and all(getattr(m, "_compiled", False) for m in norms)
    assert trainer.policy.config.bias_activation_fusion  # megatron's compiled SwiGLU path
    from megatron.core.fusions import fused_bias_swiglu

    assert getattr(fused_bias_swiglu.swiglu, "_miles_like_dynamic", False)
    assert packed_rope.rotation_of(trainer.policy.config) is not None

    lp_bound, grad_rel = BOUNDS[dtype]
    assert lp_c[0].dtype == lp_e[0].dtype
    assert max_abs_diff(lp_c, lp_e) <= lp_bound
    assert max_abs_diff(ent_c, ent_e) <= lp_bound
    for key in ("loss", "pg_loss", "entropy"):
        assert m_c[key] == pytest.approx(m_e[key], abs=lp_bound)
    # on-policy first update: old log-probs are the compiled forward's own
    assert m_c["ppo_kl"] == 0.0 and m_c["ratio_max"] == 1.0 and m_c["clipfrac"] == 0.0
    for a, b in zip(g_c, g_e, strict=True):
        scale = float(b.abs().max())
        assert scale > 0
        assert float((a - b).abs().max()) <= grad_rel * scale
    assert m_c["grad_norm"] == pytest.approx(m_e["grad_norm"], rel=grad_rel)

    # compiled once for any length: a batch of new lengths compiles nothing more
    graphs = compiled.compiled_graphs()
    other = scenarios.fixed_batch(trainer.vocab_size)
    cut = [t[:-1] for t in other.tokens]  # every sample one token shorter
    adv = [a[:-1] for a in other.advantages]
    trainer.train_step(dataclasses.replace(other, tokens=cut, advantages=adv))
    assert compiled.compiled_graphs() == graphs


def test_wrong_compiled_rotation_is_caught(tiny_hf_checkpoints, monkeypatch):
    """The comparison above can fail: a compiled rotation with the transposed sign (the
    backward's formula used forward) gives log-probs far outside the float32 bound."""
    from trainer import packed_rope

    def transposed(x, cos, sin, sign: float):
        return packed_rope.rotate_fused(x, cos, sin, -sign)

    _, directory = tiny_hf_checkpoints("qwen2")
    _, lp_e, _, _, _ = _run(directory, "float32", compile=False)
    monkeypatch.setattr(packed_rope, "_compiled_rotation", torch.compile(transposed, dynamic=True))
    _, lp_c, _, _, _ = _run(directory, "float32", compile=True)
    assert max_abs_diff(lp_c, lp_e) > 1e-3

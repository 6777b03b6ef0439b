"""`trainer/response_rows.py`: the last layer past its attention and the LM head on the response
rows only, against the full forward of the same model sliced afterwards.

One megatron policy on a tiny checkpoint (qwen3: q/k-norms too) scores and back-propagates a
mixed-length batch in several packed micro-batches twice: with every row (the reference: logits
at all positions, the response ones picked out after the model) and with the selected rows.
Log-probs, entropy and every parameter's gradient must agree within rounding (the smaller
matrix multiplies may round differently): float64 to 1e-13, float32 to 1e-5 of each tensor's
largest entry. The selected forward must really return fewer rows than the packed length.
"""

from __future__ import annotations

import pytest
import torch

import scenarios
from trainer_helpers import max_abs_diff

BOUNDS = {"float32": 1e-5, "float64": 1e-13}


def _score(trainer, batch, response_rows: bool):
    """Per-sample response log-probs and entropy; the model output's row counts seen."""
    from trainer.logprobs import vocab_parallel_logprobs

    rows_seen = []

    def fn(logits, mb):
        rows_seen.append((logits.shape[1], mb.num_tokens, mb.logit_rows.numel()))
        picked = mb.reads_of(logits[0]) if response_rows else logits[0][mb.read_rows]
        out = vocab_parallel_logprobs(picked, mb.read_targets, vocab_size=trainer.vocab_size)
        return {"lp": out.logprobs, "ent": out.entropy}

    out = trainer.policy.per_sample(batch, fn, response_rows=response_rows)
    return out["lp"], out["ent"], rows_seen


def _grads(trainer, batch, response_rows: bool) -> list[torch.Tensor]:
    """Gradient of sum(weight * log-prob) over the response tokens, weights fixed per token."""
    from trainer.logprobs import vocab_parallel_logprobs

    weights = torch.Generator().manual_seed(3)

    def loss_fn(mb, logits):
        picked = mb.reads_of(logits[0]) if response_rows else logits[0][mb.read_rows]
        lp = vocab_parallel_logprobs(
            picked, mb.read_targets, vocab_size=trainer.vocab_size
        ).logprobs
        w = torch.randn(lp.shape, generator=weights, dtype=lp.dtype)
        return (w * lp).sum(), torch.tensor(1), {}

    trainer.policy.train_micro_batches(batch, loss_fn, response_rows=response_rows)
    return [p.main_grad.detach().clone() for p in trainer.policy.params]


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_selected_rows_match_the_full_forward(dtype, tiny_hf_checkpoints):
    from trainer.megatron_trainer import MegatronTrainer

    _, directory = tiny_hf_checkpoints("qwen3")
    trainer = MegatronTrainer(scenarios.trainer_config(directory, dtype=dtype))
    batch = scenarios.fixed_batch(trainer.vocab_size)
    bound = BOUNDS[dtype]

    lp_full, ent_full, seen_full = _score(trainer, batch, response_rows=False)
    lp_sel, ent_sel, seen_sel = _score(trainer, batch, response_rows=True)
    assert len(seen_sel) > 1  # several micro-batches
    assert all(rows == total for rows, total, _ in seen_full)
    assert all(rows == resp < total for rows, total, resp in seen_sel)
    assert max_abs_diff(lp_sel, lp_full) <= bound
    assert max_abs_diff(ent_sel, ent_full) <= bound

    g_full = _grads(trainer, batch, response_rows=False)
    g_sel = _grads(trainer, batch, response_rows=True)
    for a, b in zip(g_sel, g_full, strict=True):
        scale = float(b.abs().max())
        assert scale > 0
        assert float((a - b).abs().max()) <= bound * scale

    # the selection ends with its forward: an unselected forward sees every row again
    *_, seen_after = _score(trainer, batch, response_rows=False)
    assert seen_after == seen_full

"""Shared prompts (`trainer/packing.py`, `shared_prompt_attention`): a prompt several samples of
a micro-batch share is computed once and its responses attend to it as in their own sequences.

The layout is checked by hand on a small batch. On a tiny checkpoint a megatron policy scores
and back-propagates a batch of GRPO-like groups (three prompts, groups of 4, 1 and 3, mixed
response lengths, members interleaved) with sharing on and off: log-probs, entropy, every
parameter's gradient and a whole PPO train step must agree within rounding (float64 1e-13,
float32 1e-5 of each tensor's largest entry), and the log-probs must equal HF transformers'
one sequence at a time (float32, 1e-5). The shared micro-batches must really hold fewer rows.
"""

from __future__ import annotations

import pytest
import torch

from trainer.config import RLBatch
from trainer.packing import pack, pack_all, plan_micro_batches

import scenarios
from trainer_helpers import hf_response_logprobs, max_abs_diff

BOUNDS = {"float32": 1e-5, "float64": 1e-13}


def test_layout_by_hand():
    # samples 0, 1, 3 share the prompt [1, 2, 3]; sample 2 has its own ([9, 8])
    tokens = [[1, 2, 3, 4, 5], [1, 2, 3, 7], [9, 8, 6], [1, 2, 3, 8, 8, 8]]
    mb = pack(tokens, [3, 3, 2, 3], [0, 1, 2, 3], share_prompts=True)
    assert mb.sample_indices == (0, 1, 3, 2)  # group by group
    assert mb.input_ids.tolist() == [[1, 2, 3, 4, 5, 7, 8, 8, 8, 9, 8, 6]]
    assert mb.position_ids.tolist() == [[0, 1, 2, 3, 4, 3, 3, 4, 5, 0, 1, 2]]
    assert mb.cu_seqlens.tolist() == [0, 3, 5, 6, 9, 12]  # prompt, 3 responses, sample 2
    assert mb.max_seqlen == 6
    # the prompt's last row (2) predicts each sample's first response token
    assert mb.read_rows.tolist() == [2, 3, 2, 2, 6, 7, 10]
    assert mb.read_targets.tolist() == [4, 5, 7, 8, 8, 8, 6]
    assert mb.logit_rows.tolist() == [2, 3, 6, 7, 10]
    assert mb.logit_rows[mb.read_index].tolist() == mb.read_rows.tolist()
    # attention's per-sample sequences: [prompt, response] for each sample
    assert mb.shared.expand.tolist() == [0, 1, 2, 3, 4, 0, 1, 2, 5, 0, 1, 2, 6, 7, 8, 9, 10, 11]
    assert mb.shared.cu_seqlens.tolist() == [0, 5, 9, 15, 18]
    assert mb.shared.pick.tolist() == [0, 1, 2, 3, 4, 8, 12, 13, 14, 15, 16, 17]
    assert torch.equal(mb.shared.expand[mb.shared.pick], torch.arange(12))
    # responses of no token: nothing is read, the model's selection keeps every row
    empty = pack([[1, 2], [3]], [2, 1], [0, 1])
    assert empty.read_rows.numel() == 0 and empty.logit_rows.tolist() == [0, 1, 2]
    assert empty.reads_of(torch.ones(3, 5)).shape == (0, 5)
    # no prompt shared: the plain layout
    plain = pack(tokens, [3, 3, 2, 3], [0, 2], share_prompts=True)
    assert plain.shared is None and plain.read_index is None
    assert plain.input_ids.tolist() == [[1, 2, 3, 4, 5, 9, 8, 6]]


def test_plan_counts_a_shared_prompt_once():
    lengths, prompts = [5, 4, 3, 6], [3, 3, 2, 3]
    groups = [[0, 1, 3], [2]]
    # 5 + 1 + 3 = 9 rows for the group, 3 for sample 2
    assert plan_micro_batches(lengths, 9, prompts, groups) == [[0, 1, 3], [2]]
    assert plan_micro_batches(lengths, 8, prompts, groups) == [[0, 1], [3], [2]]
    with pytest.raises(ValueError, match="max_tokens_per_micro_batch"):
        plan_micro_batches(lengths, 5, prompts, groups)
    tokens = [[1, 2, 3, 4, 5], [1, 2, 3, 7], [9, 8, 6], [1, 2, 3, 8, 8, 8]]
    mbs = pack_all(tokens, prompts, 9, share_prompts=True)
    assert [m.sample_indices for m in mbs] == [(0, 1, 3), (2,)]
    assert [m.num_tokens for m in mbs] == [9, 3]


def grouped_batch(vocab_size: int) -> RLBatch:
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, vocab_size, (p,), generator=g).tolist() for p in (5, 3, 6)]
    # (prompt, response length), the groups' members interleaved
    spec = [(0, 4), (1, 5), (0, 1), (2, 2), (0, 6), (2, 7), (2, 3), (0, 3)]
    tokens = [
        prompts[k] + torch.randint(0, vocab_size, (r,), generator=g).tolist() for k, r in spec
    ]
    prompt_lens = [len(prompts[k]) for k, _ in spec]
    advantages = [torch.randn(len(t) - p, generator=g) for t, p in zip(tokens, prompt_lens)]
    return RLBatch(tokens=tokens, prompt_lens=prompt_lens, advantages=advantages)


def _trainer(directory, dtype: str, share: bool):
    from trainer.megatron_trainer import MegatronTrainer

    # 24 rows: the batch's 51 packed rows take three micro-batches (72 rows, four, unshared)
    cfg = scenarios.trainer_config(
        directory, dtype=dtype, max_tokens_per_micro_batch=24, share_prompts=share
    )
    return MegatronTrainer(cfg)


def _grads(trainer, batch) -> list[torch.Tensor]:
    """Gradient of sum(weight * log-prob) over the response tokens, fixed weights per sample."""
    from trainer.logprobs import vocab_parallel_logprobs

    g = torch.Generator().manual_seed(3)
    lengths = [len(t) - p for t, p in zip(batch.tokens, batch.prompt_lens)]
    weights = [torch.randn(n, generator=g) for n in lengths]

    def loss_fn(mb, logits):
        lp = vocab_parallel_logprobs(
            mb.reads_of(logits[0]), mb.read_targets, vocab_size=trainer.vocab_size
        ).logprobs
        w = torch.cat([weights[i] for i in mb.sample_indices]).to(lp.dtype)
        return (w * lp).sum(), torch.tensor(1), {"rows": mb.num_tokens, "shared": mb.shared}

    stored = trainer.policy.train_micro_batches(batch, loss_fn, response_rows=True)
    return [p.main_grad.detach().clone() for p in trainer.policy.params], stored


@pytest.mark.parametrize("family", ["qwen3", "llama"])
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_shared_prompts_match_separate_sequences(family, dtype, tiny_hf_checkpoints):
    hf_model, directory = tiny_hf_checkpoints(family)
    batch = grouped_batch(hf_model.config.vocab_size)
    bound = BOUNDS[dtype]
    shared, separate = _trainer(directory, dtype, True), _trainer(directory, dtype, False)

    lp, ent = shared.compute_logprobs(batch, with_entropy=True)
    lp_ref, ent_ref = separate.compute_logprobs(batch, with_entropy=True)
    assert max_abs_diff(lp, lp_ref) <= bound
    assert max_abs_diff(ent, ent_ref) <= bound
    hf_lp, hf_ent = hf_response_logprobs(hf_model, batch.tokens, batch.prompt_lens)
    assert max_abs_diff(lp, hf_lp) <= 1e-5
    assert max_abs_diff(ent, hf_ent) <= 1e-5

    g_shared, stored = _grads(shared, batch)
    g_separate, stored_ref = _grads(separate, batch)
    assert any(m["shared"] is not None for m in stored)
    assert all(m["shared"] is None for m in stored_ref)
    assert sum(m["rows"] for m in stored) < sum(m["rows"] for m in stored_ref)
    for a, b in zip(g_shared, g_separate, strict=True):
        scale = float(b.abs().max())
        assert scale > 0
        assert float((a - b).abs().max()) <= bound * scale


def test_train_step_shared_equals_separate(tiny_hf_checkpoints):
    """A whole PPO step in float64 (old log-probs from the step's own forward, entropy bonus,
    AdamW): the same metrics, old log-probs and new weights either way."""
    hf_model, directory = tiny_hf_checkpoints("qwen2")
    batch = grouped_batch(hf_model.config.vocab_size)
    runs = []
    for share in (True, False):
        trainer = _trainer(directory, "float64", share)
        scored = trainer.train_step_scored(batch)
        runs.append((scored, trainer.hf_state_dict()))
    (a, weights_a), (b, weights_b) = runs
    assert a.metrics.keys() == b.metrics.keys()
    for key in a.metrics:
        assert a.metrics[key] == pytest.approx(b.metrics[key], rel=1e-12, abs=1e-13), key
    assert a.metrics["ppo_kl"] == 0.0
    assert max_abs_diff(a.old_logprobs, b.old_logprobs) <= 1e-13
    moved = max(float((weights_a[k] - hf_model.state_dict()[k]).abs().max()) for k in weights_a)
    assert moved > 1e-6  # the step changed the weights
    for name in weights_a:
        assert float((weights_a[name] - weights_b[name]).abs().max()) <= 1e-12, name

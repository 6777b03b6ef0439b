"""Unit checks: vocab-parallel log-probs (TP=1 path), packing, the configs megatron cannot
build, LR schedule."""

from __future__ import annotations

import math

import pytest
import torch

from model_spec import ModelSpec, UnsupportedModelError
from trainer.config import OptimConfig
from trainer.megatron_model import transformer_config
from trainer.optim import lr_at
from trainer.packing import pack, pack_all, plan_micro_batches


@pytest.fixture(scope="module")
def world():
    from trainer.parallel import init_parallel

    init_parallel()


@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_vocab_parallel_logprobs_match_log_softmax(world, temperature):
    from trainer.logprobs import vocab_parallel_logprobs

    g = torch.Generator().manual_seed(0)
    vocab, padded = 11, 16
    logits = torch.randn(7, padded, generator=g, dtype=torch.float64) * 3
    logits[:, vocab:] = 50.0  # padded rows must be ignored however large they are
    logits.requires_grad_()
    targets = torch.randint(0, vocab, (7,), generator=g)
    out = vocab_parallel_logprobs(logits, targets, vocab_size=vocab, temperature=temperature)
    ref_logits = logits[:, :vocab] / temperature
    logp = torch.log_softmax(ref_logits, dim=-1)
    ref_lp = logp.gather(-1, targets[:, None])[:, 0]
    ref_ent = -(logp.exp() * logp).sum(-1)
    torch.testing.assert_close(out.logprobs, ref_lp, atol=1e-12, rtol=0)
    torch.testing.assert_close(out.entropy, ref_ent, atol=1e-12, rtol=0)
    # gradients of a mixed objective agree with autograd through log_softmax
    (out.logprobs.sum() + 0.3 * out.entropy.sum()).backward()
    got = logits.grad.clone()
    logits.grad = None
    (ref_lp.sum() + 0.3 * ref_ent.sum()).backward()
    torch.testing.assert_close(got, logits.grad, atol=1e-12, rtol=0)
    assert torch.all(got[:, vocab:] == 0)


def test_plan_respects_budget_and_order():
    assert plan_micro_batches([5, 3, 4, 8, 1], 8) == [[0, 1], [2], [3], [4]]
    with pytest.raises(ValueError, match="max_tokens_per_micro_batch"):
        plan_micro_batches([5, 9], 8)


def test_pack_layout():
    tokens = [[10, 11, 12, 13], [20, 21, 22]]
    mb = pack(tokens, [2, 1], [0, 1])
    assert mb.input_ids.tolist() == [[10, 11, 12, 13, 20, 21, 22]]
    assert mb.position_ids.tolist() == [[0, 1, 2, 3, 0, 1, 2]]
    assert mb.cu_seqlens.tolist() == [0, 4, 7] and mb.max_seqlen == 4
    # row 1 predicts 12, row 2 13; row 4 predicts 21, row 5 22
    assert mb.read_rows.tolist() == [1, 2, 4, 5] and mb.read_targets.tolist() == [12, 13, 21, 22]
    assert mb.logit_rows.tolist() == [1, 2, 4, 5] and mb.read_index is None
    assert mb.shared is None
    with pytest.raises(ValueError, match="prompt_len"):
        pack(tokens, [0, 1], [0])
    assert [m.sample_indices for m in pack_all(tokens, [2, 1], 4)] == [(0,), (1,)]


def test_megatron_refuses_the_biases_it_cannot_build():
    """megatron biases every linear or none (q/k/v apart): an o_proj or MLP bias, which the
    engine runs, is refused naming the config.json key (before any parallel state is needed)."""
    base = dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=97,
    )
    for family, key in [
        ("llama", "attention_bias"),
        ("qwen3", "attention_bias"),
        ("llama", "mlp_bias"),
    ]:
        spec = ModelSpec.from_hf({**base, "model_type": family, key: True})
        with pytest.raises(UnsupportedModelError, match=f"config.json {key}=true with {family}"):
            transformer_config(spec)


def test_lr_schedule_closed_form():
    cfg = OptimConfig(lr=1.0, min_lr=0.1, warmup_steps=4, total_steps=14, lr_schedule="cosine")
    assert [lr_at(s, cfg) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert lr_at(4, cfg) == pytest.approx(1.0)
    assert lr_at(9, cfg) == pytest.approx(0.1 + 0.45 * (1 + math.cos(math.pi * 0.5)))
    assert lr_at(14, cfg) == pytest.approx(0.1) and lr_at(100, cfg) == pytest.approx(0.1)
    const = OptimConfig(lr=2.0, warmup_steps=2)
    assert [lr_at(s, const) for s in range(4)] == [1.0, 2.0, 2.0, 2.0]
    with pytest.raises(ValueError, match="lr_schedule"):
        OptimConfig(lr_schedule="linear")


@pytest.mark.parametrize("loss_agg", ["token-mean", "seq-mean", "seq-mean-token-sum"])
@pytest.mark.parametrize("policy_loss", ["ppo", "gspo", "sft"])
def test_micro_batch_shares_sum_to_the_batch_objective(loss_agg, policy_loss):
    """The invariant the backends rely on: objectives of any split of the batch into
    micro-batches, normalized globally, sum to the objective of the batch in one piece."""
    from trainer import objective
    from trainer.config import LossConfig, RLBatch

    g = torch.Generator().manual_seed(3)
    tokens = [torch.randint(0, 50, (n,), generator=g).tolist() for n in (6, 9, 4, 7)]
    prompts = [2, 3, 1, 4]
    resp = [len(t) - p for t, p in zip(tokens, prompts)]

    def rand():
        return [torch.randn(n, generator=g, dtype=torch.float64) for n in resp]

    batch = RLBatch(
        tokens=tokens,
        prompt_lens=prompts,
        advantages=rand(),
        old_logprobs=[-x.abs() for x in rand()],
        ref_logprobs=[-x.abs() for x in rand()],
        rollout_logprobs=[-x.abs() for x in rand()],
        loss_masks=[(torch.rand(n, generator=g) > 0.2).double() for n in resp],
    )
    logprobs = [-x.abs() for x in rand()]
    entropy = [x.abs() for x in rand()]
    cfg = LossConfig(
        policy_loss=policy_loss,
        loss_agg=loss_agg,
        clip_low=0.2,
        clip_high=0.3,
        kl_coef=0.1,
        kl_type="k3",
        entropy_coef=0.01,
        is_correction=None if policy_loss == "sft" else "tis",
    )
    norm = objective.normalizers(batch)

    def total(budget):
        loss, metric_sum = 0.0, {}
        for mb in pack_all(tokens, prompts, budget):
            data = objective.token_data(batch, mb, torch.device("cpu"))
            lp = torch.cat([logprobs[i] for i in mb.sample_indices])
            ent = torch.cat([entropy[i] for i in mb.sample_indices])
            share, metrics = objective.micro_batch_objective(lp, ent, data, cfg, norm)
            loss += float(share)
            for k, v in metrics.items():
                metric_sum[k] = (
                    max(metric_sum.get(k, 0.0), float(v))
                    if k == "ratio_max"
                    else metric_sum.get(k, 0.0) + float(v)
                )
        return loss, metric_sum

    whole, whole_metrics = total(1000)
    split, split_metrics = total(9)
    assert len(pack_all(tokens, prompts, 9)) == 4
    assert split == pytest.approx(whole, abs=1e-12)
    for k in whole_metrics:
        assert split_metrics[k] == pytest.approx(whole_metrics[k], abs=1e-12), k


def test_cpu_compat_is_module_scoped():
    """The shim reaches megatron's modules, and nothing else: torch.cuda still says no CUDA."""
    from trainer import cpu_compat

    if not cpu_compat.needed():
        pytest.skip("CUDA present: the shim is not applied")
    assert cpu_compat.apply()
    from megatron.core.tensor_parallel import mappings

    assert mappings.torch.cuda.current_device() == "cpu"
    assert mappings.torch.zeros(2, device="cuda").device.type == "cpu"
    assert torch.cuda.is_available() is False
    with pytest.raises((AssertionError, RuntimeError)):
        torch.cuda.current_device()


def test_explained_variance_closed_forms():
    from trainer.critic import explained_variance

    g = torch.Generator().manual_seed(0)
    returns = [torch.rand(n, generator=g) for n in (3, 5, 2)]
    mean = float(torch.cat(returns).mean())
    assert explained_variance(returns, returns) == 1.0  # perfect critic
    assert abs(explained_variance([torch.full_like(r, mean) for r in returns], returns)) < 1e-12
    # V = R + noise: 1 - Var(noise) / Var(R), computed by hand
    noise = [torch.randn(r.shape, generator=g) * 0.1 for r in returns]
    r, e = torch.cat(returns).double(), torch.cat(noise).double()
    expected = 1 - float(e.var(unbiased=False) / r.var(unbiased=False))
    got = explained_variance([a + b for a, b in zip(returns, noise)], returns)
    assert abs(got - expected) < 1e-6
    # masked-out tokens do not count, however wrong their values
    masks = [torch.tensor([1.0, 1.0, 0.0]), torch.ones(5), torch.ones(2)]
    wrong = [returns[0].clone(), returns[1], returns[2]]
    wrong[0][2] = 100.0
    assert explained_variance(wrong, returns, masks) == 1.0
    assert math.isnan(explained_variance([torch.zeros(2)], [torch.ones(2)]))  # Var(R) = 0

"""Both backends honour `RLBatch.loss_masks` everywhere: a first PPO step with TIS, a k3 KL
term and an entropy bonus on a batch whose masked-out tokens carry garbage (huge advantages,
engine log-prob 0 as an appended tool token has, a far reference) gives exactly the objective
computed by hand from HF transformers' log-probs over the masked tokens only, the same gradient
norm as HF autograd of that hand loss, and the same metrics and weights whatever the garbage."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from trainer.config import LossConfig

import scenarios

CAP, KL_COEF, ENT_COEF = 1.5, 0.1, 0.01


def loss_config() -> LossConfig:
    return LossConfig(
        policy_loss="ppo",
        clip_low=0.2,
        clip_high=0.28,
        entropy_coef=ENT_COEF,
        kl_coef=KL_COEF,
        kl_type="k3",
        is_correction="tis",
        is_cap=CAP,
    )


def masked_batch(vocab_size: int, garbage: float):
    """The fixed batch with every third response token masked out, and its per-token data:
    real values under the mask, `garbage`-dependent values outside it."""
    batch = scenarios.fixed_batch(vocab_size)
    g = torch.Generator().manual_seed(7)
    masks, rollout, ref, adv = [], [], [], []
    for i, a in enumerate(batch.advantages):
        n = a.numel()
        m = torch.ones(n)
        m[(torch.arange(n) + i) % 3 == 2] = 0.0
        masks.append(m)
        rollout.append(torch.where(m > 0, -torch.rand(n, generator=g) * 3, torch.zeros(n)))
        ref.append(torch.where(m > 0, -torch.rand(n, generator=g) * 3, torch.full((n,), -garbage)))
        adv.append(torch.where(m > 0, a, torch.full((n,), garbage)))
    return dataclasses.replace(
        batch, advantages=adv, loss_masks=masks, rollout_logprobs=rollout, ref_logprobs=ref
    )


def hand_objective(hf_model, batch):
    """(loss, pg_loss, kl, entropy, logprob diffs) by hand, with the HF model's autograd."""
    lps, ents = [], []
    for seq, p in zip(batch.tokens, batch.prompt_lens):
        logp = torch.log_softmax(hf_model(torch.tensor([seq])).logits[0].float(), dim=-1)
        rows = torch.arange(p - 1, len(seq) - 1)
        lps.append(logp[rows, torch.tensor(seq[p:])])
        ents.append(-(logp[rows].exp() * logp[rows]).sum(-1))
    lp, ent = torch.cat(lps), torch.cat(ents)
    m = torch.cat(batch.loss_masks) > 0
    lp, ent = lp[m], ent[m]
    old = lp.detach()
    adv, rollout, ref = (
        torch.cat(x)[m].float()
        for x in (batch.advantages, batch.rollout_logprobs, batch.ref_logprobs)
    )
    ratio = torch.exp(lp - old)  # 1, with the policy's gradient
    w = torch.exp(old - rollout).clamp(max=CAP)  # TIS
    pg = (-adv * ratio * w).mean()
    log_r = lp - ref
    kl = (torch.exp(-log_r) - 1 + log_r).mean()
    loss = pg + KL_COEF * kl - ENT_COEF * ent.mean()
    return loss, pg, kl, ent.mean(), (old - rollout).abs()


def hf_grad_norm(hf_model, loss) -> float:
    hf_model.zero_grad()
    loss.backward()
    norm = torch.sqrt(
        sum(p.grad.double().square().sum() for p in hf_model.parameters() if p.grad is not None)
    )
    hf_model.zero_grad()
    return float(norm)


def make(backend: str, directory):
    cfg = scenarios.trainer_config(
        directory, backend=backend, loss=loss_config(), use_reference=True
    )
    if backend == "megatron":
        from trainer.megatron_trainer import MegatronTrainer

        return MegatronTrainer(cfg)
    from trainer.deepspeed_trainer import DeepSpeedTrainer

    return DeepSpeedTrainer(cfg)


@pytest.mark.parametrize("backend", ["megatron", "deepspeed"])
def test_first_step_counts_only_masked_tokens(backend, tiny_hf_checkpoints):
    hf_model, directory = tiny_hf_checkpoints("qwen2")
    batch = masked_batch(hf_model.config.vocab_size, garbage=1e3)
    loss, pg, kl, ent, diff = hand_objective(hf_model, batch)
    want_norm = hf_grad_norm(hf_model, loss)

    trainer = make(backend, directory)
    metrics = trainer.train_step(batch)
    assert metrics["ratio_max"] == 1.0 and metrics["clipfrac"] == 0.0
    for key, want in (("loss", loss), ("pg_loss", pg), ("kl", kl), ("entropy", ent)):
        assert metrics[key] == pytest.approx(float(want.detach()), rel=1e-5, abs=1e-6), key
    assert metrics["logprob_diff_max"] == pytest.approx(float(diff.max()), abs=1e-5)
    assert metrics["logprob_diff_mean"] == pytest.approx(float(diff.mean()), abs=1e-5)
    assert metrics["grad_norm"] == pytest.approx(want_norm, rel=1e-4)

    # other garbage outside the mask: the same step, to the bit
    again = make(backend, directory)
    metrics2 = again.train_step(masked_batch(hf_model.config.vocab_size, garbage=-7.0))
    assert metrics2 == metrics
    after, after2 = trainer.hf_state_dict(), again.hf_state_dict()
    assert all(torch.equal(after[k], after2[k]) for k in after)

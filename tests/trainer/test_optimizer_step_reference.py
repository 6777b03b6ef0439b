"""The optimizer step against an independent reference: HF transformers on the same weights, a
PPO / GRPO loss written below from the formulas (this file imports neither `trainer.objective`
nor `trainer.losses`), gradient clipping by `torch.nn.utils.clip_grad_norm_` and
`torch.optim.AdamW`. After 1 and 3 steps on the same batch the backends' weights, losses and
gradient norms must equal the reference's.

The batch exercises every branch: old log-probs far from the current ones (ratios from ~0.1 to
~10, so clip-low, clip-high = DAPO's clip-higher, and the dual clip all trigger: counted), a
low-var-kl term to a frozen reference, an entropy bonus, per-sequence advantages of both signs,
truncated importance sampling against "engine" log-probs, and loss masks with zeros inside the
response. Several micro-batches per step, so gradient accumulation is covered too.

megatron runs in float64 (bound 1e-10: rounding only). DeepSpeed cannot: its ZeRO optimizer
keeps float32 master partitions whatever the model dtype, so it runs in float32 against the
same float64 reference (bound from float32 rounding).
"""

from __future__ import annotations

import copy
from typing import NamedTuple

import pytest
import torch
from exact_float64 import exact_float64

from trainer import make_trainer
from trainer.config import LossConfig, OptimConfig, RLBatch, TrainerConfig

from tiny_hf import make_hf_model, save_hf_model

LR, BETAS, EPS, WEIGHT_DECAY = 1e-2, (0.9, 0.95), 1e-3, 0.01
CLIP_LOW, CLIP_HIGH, DUAL_CLIP = 0.2, 0.28, 3.0
KL_COEF, ENTROPY_COEF, TEMPERATURE, TIS_CAP = 0.1, 0.01, 0.9, 1.5
BOUNDS = {"megatron": 1e-10, "deepspeed": 2e-5}


class Case(NamedTuple):
    agg: str  # token-mean | seq-mean
    tis: bool  # truncated importance sampling against the "engine" log-probs
    grad_clip: float | None  # max grad norm (it triggers: the norms here are > 1)


# Clipping to a norm makes the update blind to the gradient's scale (so to a wrong loss
# normalizer); without it, Adam's eps keeps the update sensitive to that scale.
CASES = {
    "token-mean": Case("token-mean", False, None),
    "seq-mean-tis-clip": Case("seq-mean", True, 1.0),
}


# ----------------------------------------------------------------------------- the batch


def make_batch(vocab: int) -> RLBatch:
    """Tokens, per-sequence advantages of both signs, masks with zeros inside responses."""
    g = torch.Generator().manual_seed(7)
    lengths, prompts = (11, 8, 14, 9), (3, 2, 6, 4)
    tokens = [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]
    adv_values = (1.3, -0.8, -1.7, 0.6)
    advantages = [
        torch.full((n - p,), a, dtype=torch.float64)
        for n, p, a in zip(lengths, prompts, adv_values)
    ]
    masks = []
    for n, p in zip(lengths, prompts):
        m = torch.ones(n - p, dtype=torch.float64)
        m[1:3] = 0.0  # e.g. tool output inside a multi-turn response
        masks.append(m)
    batch = RLBatch(
        tokens=tokens, prompt_lens=list(prompts), advantages=advantages, loss_masks=masks
    )
    return batch


def with_old_logprobs(batch: RLBatch, initial: list[torch.Tensor]) -> RLBatch:
    """Old and "engine" log-probs scattered around the initial policy's, so ratios are far
    from 1 from the first step on."""
    g = torch.Generator().manual_seed(11)
    old = [lp - 1.2 * torch.randn(lp.shape, generator=g, dtype=torch.float64) for lp in initial]
    engine = [o + 0.3 * torch.randn(o.shape, generator=g, dtype=torch.float64) for o in old]
    return RLBatch(
        tokens=batch.tokens,
        prompt_lens=batch.prompt_lens,
        advantages=batch.advantages,
        loss_masks=batch.loss_masks,
        old_logprobs=old,
        rollout_logprobs=engine,
    )


# ----------------------------------------------------------------------------- the reference


def response_logprobs_entropy(model, tokens: list[int], prompt_len: int):
    ids = torch.tensor([tokens])
    z = model(ids).logits[0, prompt_len - 1 : -1].double() / TEMPERATURE
    logp = torch.log_softmax(z, dim=-1)
    picked = logp.gather(-1, ids[0, prompt_len:, None])[:, 0]
    return picked, -(logp.exp() * logp).sum(-1)


class Counts(NamedTuple):
    clip_low: int
    clip_high: int
    dual: int


def reference_loss(model, frozen, batch: RLBatch, case: Case) -> tuple[torch.Tensor, Counts]:
    """J = agg over the masked response tokens of

        max(-A r, -A clip(r, 1 - eps_lo, 1 + eps_hi)), for A < 0 at most -c A   PPO, DAPO, dual
          x min(pi_old / pi_engine, cap)                                         TIS
        + beta clamp(pi_ref / pi - 1 - log(pi_ref / pi), -10, 10)               low-var-kl
        - alpha H(pi)                                                            entropy

    with r = pi / pi_old; agg = token-mean (all masked tokens of the batch) or seq-mean (the mean
    over sequences of each one's masked token mean)."""
    per_seq_sums, per_seq_counts = [], []
    low = high = dual = 0
    for i, (tokens, p) in enumerate(zip(batch.tokens, batch.prompt_lens)):
        lp, ent = response_logprobs_entropy(model, tokens, p)
        with torch.no_grad():
            ref, _ = response_logprobs_entropy(frozen, tokens, p)
        a, m = batch.advantages[i], batch.loss_masks[i]
        r = torch.exp(lp - batch.old_logprobs[i])
        surrogate = torch.maximum(-a * r, -a * r.clamp(1 - CLIP_LOW, 1 + CLIP_HIGH))
        surrogate = torch.where(a < 0, torch.minimum(surrogate, -DUAL_CLIP * a), surrogate)
        if case.tis:
            w = torch.exp(batch.old_logprobs[i] - batch.rollout_logprobs[i]).clamp(max=TIS_CAP)
            surrogate = surrogate * w
        log_q = ref - lp  # log(pi_ref / pi)
        kl = (torch.exp(log_q) - 1 - log_q).clamp(-10, 10)
        per_token = surrogate + KL_COEF * kl - ENTROPY_COEF * ent
        per_seq_sums.append((per_token * m).sum())
        per_seq_counts.append(m.sum())
        on = m > 0
        r_ = r.detach()
        low += int(((a < 0) & (r_ < 1 - CLIP_LOW) & on).sum())
        high += int(((a > 0) & (r_ > 1 + CLIP_HIGH) & on).sum())
        dual += int(((a < 0) & (r_ > DUAL_CLIP) & on).sum())
    sums, counts = torch.stack(per_seq_sums), torch.stack(per_seq_counts)
    loss = sums.sum() / counts.sum() if case.agg == "token-mean" else (sums / counts).mean()
    return loss, Counts(low, high, dual)


def reference_steps(model, batch: RLBatch, case: Case, steps: int):
    """(weights after each step, loss and grad norm of each step, branch counts of step 1)."""
    frozen = copy.deepcopy(model).requires_grad_(False)
    params = dict(model.named_parameters())
    opt = torch.optim.AdamW(
        [
            {"params": [p for p in params.values() if p.ndim >= 2], "weight_decay": WEIGHT_DECAY},
            {"params": [p for p in params.values() if p.ndim < 2], "weight_decay": 0.0},
        ],
        lr=LR,
        betas=BETAS,
        eps=EPS,
    )
    weights, losses, norms, counts = [], [], [], None
    for _ in range(steps):
        opt.zero_grad()
        loss, c = reference_loss(model, frozen, batch, case)
        counts = counts or c
        loss.backward()
        norms.append(
            float(torch.nn.utils.clip_grad_norm_(params.values(), case.grad_clip or float("inf")))
        )
        opt.step()
        losses.append(float(loss.detach()))
        weights.append({k: v.detach().clone() for k, v in params.items()})
    return weights, losses, norms, counts


# ----------------------------------------------------------------------------- the backends


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A float64 checkpoint whose values are float32-representable, so the float32 DeepSpeed
    run and the float64 runs start from exactly the same weights."""
    model = make_hf_model("qwen2", seed=5).to(torch.float64)
    return save_hf_model(model, tmp_path_factory.mktemp("ref_qwen2"))


def backend_config(directory, backend: str, case: Case) -> TrainerConfig:
    return TrainerConfig(
        model_path=str(directory),
        backend=backend,
        dtype="float64" if backend == "megatron" else "float32",
        max_tokens_per_micro_batch=16,
        use_reference=True,
        optim=OptimConfig(
            lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY, grad_clip=case.grad_clip
        ),
        loss=LossConfig(
            policy_loss="ppo",
            clip_low=CLIP_LOW,
            clip_high=CLIP_HIGH,
            dual_clip=DUAL_CLIP,
            loss_agg=case.agg,
            kl_coef=KL_COEF,
            kl_type="low-var-kl",
            entropy_coef=ENTROPY_COEF,
            is_correction="tis" if case.tis else None,
            is_cap=TIS_CAP,
            temperature=TEMPERATURE,
        ),
    )


def max_diff(a: dict, b: dict) -> float:
    assert sorted(a) == sorted(b)
    return max(float((a[k].double().cpu() - b[k].double()).abs().max()) for k in a)


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("backend", ["megatron", "deepspeed"])
def test_steps_equal_the_reference(backend, case, model_dir):
    case_ = CASES[case]
    hf = exact_float64(make_hf_model("qwen2", seed=5).to(torch.float64))
    vocab = hf.config.vocab_size
    batch = make_batch(vocab)
    with torch.no_grad():
        initial = [
            response_logprobs_entropy(hf, t, p)[0] for t, p in zip(batch.tokens, batch.prompt_lens)
        ]
    batch = with_old_logprobs(batch, initial)
    start = {k: v.detach().clone() for k, v in hf.named_parameters()}
    ref_weights, ref_losses, ref_norms, counts = reference_steps(hf, batch, case_, steps=3)
    # every branch of the objective is taken, and the weights move well beyond the bound
    assert counts.clip_low > 0 and counts.clip_high > 0 and counts.dual > 0, counts
    assert max_diff(ref_weights[0], start) > 1e-3

    trainer = make_trainer(backend_config(model_dir, backend, case_))
    got = []
    for _ in range(3):
        metrics = trainer.train_step(batch)
        got.append((metrics, trainer.hf_state_dict()))
    assert got[0][0]["clipfrac"] > 0
    bound = BOUNDS[backend]
    for step in (0, 2):  # after 1 and after 3 steps
        metrics, weights = got[step]
        assert max_diff(weights, ref_weights[step]) <= bound, f"after {step + 1} steps"
        assert metrics["loss"] == pytest.approx(ref_losses[step], abs=bound, rel=bound)
        assert metrics["grad_norm"] == pytest.approx(ref_norms[step], abs=bound, rel=bound)

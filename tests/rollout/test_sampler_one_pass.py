"""The one-pass torch sampler (one exp per logit feeding both the draw and the log-prob) against the
two-pass sampler it replaced, written out below as the reference: log_softmax over the row, exp
of it for the probabilities, then the same truncation and inverse-CDF draw.

The two differ only by rounding (the draw runs on exp(x - m) instead of exp(log_softmax(x)), a
scale the inverse CDF ignores; the log-prob's log-sum is summed in a different order), so:
float64 tokens equal and log-probs within 1e-13; float32 tokens equal on these seeds
(but see the uniforms that round to 1 below) and log-probs within 4 ulps of the terms they are
computed from. Rows mix greedy, temperature, top-k, top-p and min-p, -inf logits and uniforms
that round to the total."""

import pytest
import torch

from rollout.sampler import SamplingBatch, _sample_torch, truncation_mask


def two_pass_sample(logits: torch.Tensor, batch: SamplingBatch):
    """The sampler as it was before the one-pass change (rollout/sampler.py, main 3e3ff2a)."""
    temperature = batch.temperature
    greedy = temperature == 0
    scaled = logits / torch.where(greedy, 1.0, temperature).unsqueeze(-1)
    logprobs_all = torch.log_softmax(scaled, dim=-1)
    tokens = logits.argmax(dim=-1)
    sampled = (~greedy).nonzero().squeeze(-1)
    if sampled.numel():
        probs = logprobs_all[sampled].exp_()
        top_k, top_p, min_p = (t[sampled] for t in (batch.top_k, batch.top_p, batch.min_p))
        truncating = ((top_k > 0) & (top_k < probs.shape[-1])) | (top_p < 1) | (min_p > 0)
        if truncating.any():
            rows = truncating.nonzero().squeeze(-1)
            keep = truncation_mask(probs[rows], top_k[rows], top_p[rows], min_p[rows])
            probs[rows] = probs[rows] * keep
        cdf = probs.cumsum_(dim=-1)
        threshold = batch.uniforms.to(cdf.dtype)[sampled] * cdf[:, -1]
        choice = torch.searchsorted(cdf, threshold.unsqueeze(-1), right=True).squeeze(-1)
        overflow = (choice == cdf.shape[-1]).nonzero().squeeze(-1)
        if overflow.numel():
            choice[overflow] = (cdf[overflow] < cdf[overflow, -1:]).sum(dim=-1)
        tokens[sampled] = choice
    return tokens, logprobs_all.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


def random_batch(rows: int, vocab: int, dtype: torch.dtype, seed: int, mode: str):
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(rows, vocab, generator=g) * 4).to(dtype)
    logits[: rows // 4, -vocab // 8 :] = float("-inf")  # zero-probability tails
    uniforms = torch.rand(rows, generator=g, dtype=torch.float64)
    uniforms[:3] = 1 - 2.0**-53  # threshold at the total
    pick = lambda *choices: torch.tensor(choices)[torch.randint(len(choices), (rows,), generator=g)]  # noqa: E731
    if mode == "plain":  # the benchmark's case: T = 1, no truncation, every row sampled
        temperature = torch.ones(rows)
        top_k, top_p, min_p = torch.full((rows,), -1), torch.ones(rows), torch.zeros(rows)
    else:
        temperature = pick(0.0, 0.6, 1.0, 1.3)
        top_k = pick(-1, 1, 5, 40)
        top_p = pick(1.0, 0.9, 0.5)
        min_p = pick(0.0, 0.0, 0.05)
    batch = SamplingBatch(temperature.float(), top_p.float(), top_k.long(), min_p.float(), uniforms)
    return logits, batch


@pytest.mark.parametrize("mode", ["plain", "mixed"])
@pytest.mark.parametrize("vocab", [97, 4096])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_one_pass_sampler_equals_the_two_pass_sampler(dtype, vocab, mode):
    for seed in range(4):
        logits, batch = random_batch(256, vocab, dtype, seed, mode)
        tokens, logprobs = _sample_torch(logits, batch)
        ref_tokens, ref_logprobs = two_pass_sample(logits, batch)
        # A float32 uniform that rounds to 1 (probability 2^-25 a draw) selects the last token
        # whose mass the float32 cdf still registers, which depends on the cdf's scale: both
        # samplers then pick a token of positive mass at the end of the row, checked as such.
        at_total = batch.uniforms.to(dtype) == 1
        assert torch.equal(tokens[~at_total], ref_tokens[~at_total])
        assert torch.isfinite(logits.gather(-1, tokens[at_total, None])).all()
        assert logprobs.dtype == dtype and torch.isfinite(logprobs).all()
        # the reference's log-probs of the tokens drawn (the same tokens but at_total rows)
        t = torch.where(batch.temperature == 0, 1.0, batch.temperature).to(dtype).unsqueeze(-1)
        ref_logprobs = torch.log_softmax(logits / t, -1).gather(-1, tokens[:, None]).squeeze(-1)
        assert torch.equal(ref_logprobs[~at_total], two_pass_sample(logits, batch)[1][~at_total])
        if dtype == torch.float64:
            assert (logprobs - ref_logprobs).abs().max() <= 1e-13
        else:
            # a few ulps of the largest term, max |x - m| + log sum(e) (~20 here)
            scale = (logits.masked_fill(logits.isinf(), 0).abs().amax(-1) * 2).clamp(min=1)
            assert ((logprobs - ref_logprobs).abs() <= 4 * torch.finfo(dtype).eps * scale).all()

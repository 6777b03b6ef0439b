"""The C sampling kernel (`rollout/native/sampling.c`) against the torch sampler
(`rollout.sampler._sample_torch`): rows at a temperature > 0 without truncation, -inf tails,
uniforms whose threshold rounds to the total; and `sample`'s routing of each row by its own
parameters (batch invariance)."""

from __future__ import annotations

import pytest
import torch
from native_builds import builds

from rollout import native
from rollout.sampler import SamplingBatch, _sample_torch, sample

pytestmark = pytest.mark.skipif(
    native.sampling() is None, reason="no C compiler: sampling runs in torch"
)

BUILDS = builds(native.sampling)
assert "portable" not in BUILDS or BUILDS["portable"].sampling_has_avx2() == 0


def _rows(num, vocab, seed, temperature=None):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(num, vocab, generator=g) * 4
    logits[: num // 4, -vocab // 8 :] = float("-inf")
    uniforms = torch.rand(num, generator=g, dtype=torch.float64)
    uniforms[:3] = 1 - 2.0**-53  # the threshold rounds to the total
    if temperature is None:
        temperature = torch.tensor([0.6, 1.0, 1.3])[torch.randint(3, (num,), generator=g)]
    plain = SamplingBatch(
        temperature.float(),
        torch.ones(num),
        torch.full((num,), -1, dtype=torch.int64),
        torch.zeros(num),
        uniforms,
    )
    return logits, plain


@pytest.mark.parametrize("build", sorted(BUILDS))
@pytest.mark.parametrize("vocab", [7, 97, 4096])
def test_kernel_draws_what_the_torch_sampler_draws(build, vocab):
    """Each row's token is the inverse-CDF choice of its own float64 weights, to float32
    rounding: where it differs from torch's token, the draw lies within 1e-5 (relative) of the
    boundary between the two. Log-probs within 2e-6 of float64 log_softmax; tokens equal to
    torch's in nearly every row."""
    same = total = 0
    for seed in range(3):
        logits, batch = _rows(512, vocab, seed)
        tokens, logprobs = native.sample_rows(
            BUILDS[build], logits, batch.temperature, batch.uniforms
        )
        ref_tokens, _ = _sample_torch(logits, batch)
        scaled = logits.double() / batch.temperature.double().unsqueeze(-1)
        exact = torch.log_softmax(scaled, -1).gather(-1, tokens[:, None]).squeeze(-1)
        torch.testing.assert_close(logprobs.double(), exact, atol=2e-6, rtol=0)
        cdf = torch.softmax(scaled, -1).cumsum(-1)
        u = batch.uniforms
        assert torch.isfinite(logits.gather(-1, tokens[:, None])).all()  # positive mass only
        for r in (tokens != ref_tokens).nonzero().squeeze(-1).tolist():
            lo, hi = sorted((int(tokens[r]), int(ref_tokens[r])))
            assert abs(float(cdf[r, lo]) - float(u[r])) < 1e-5 or u[r] > 1 - 1e-6, r
            assert hi - lo == 1 or not torch.isfinite(logits[r, lo + 1 : hi]).any(), r
        same += int((tokens == ref_tokens).sum())
        total += tokens.numel()
    assert same >= 0.99 * total


def test_sample_routes_rows_by_their_own_parameters():
    """A plain row draws the same token and log-prob alone or beside greedy and truncated rows
    (the kernel serves it either way); the others get exactly the torch sampler's result."""
    logits, batch = _rows(6, 300, seed=5, temperature=torch.ones(6))
    mixed = SamplingBatch(
        torch.tensor([1.0, 0.0, 1.0, 0.7, 1.0, 1.0]),
        torch.tensor([1.0, 1.0, 0.9, 1.0, 1.0, 1.0]),
        torch.tensor([-1, -1, -1, 20, -1, -1]),
        torch.zeros(6),
        batch.uniforms,
    )
    tokens, logprobs = sample(logits, mixed)
    alone = [sample(logits[i : i + 1], mixed.select(slice(i, i + 1))) for i in range(6)]
    for i, (t, lp) in enumerate(alone):
        assert int(tokens[i]) == int(t[0]) and float(logprobs[i]) == float(lp[0]), i
    others = torch.tensor([1, 2, 3])
    ref_tokens, ref_logprobs = _sample_torch(logits[others], mixed.select(others))
    assert torch.equal(tokens[others], ref_tokens) and torch.equal(logprobs[others], ref_logprobs)

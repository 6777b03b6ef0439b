"""Batched verification (`rollout.speculative.verify.verify`, every sequence walked at once on
the device) equals verifying each sequence alone with the rule written out one draft token at a
time (Leviathan et al.): same accepted count, tokens and log-probs, and each sequence's stream of
uniforms left at the same place. Batches mix draft lengths (0 to 4), point-mass and sampled (q)
drafts, greedy, plain and truncated rows."""

from __future__ import annotations

import random
import types

import torch

from rollout.config import SamplingParams
from rollout.sampler import draw_from_cdf
from rollout.speculative.verify import sampling_distribution, verify
from rollout.uniform_stream import UniformStream


def verify_one(logits, params, draft, q, stream):
    """One sequence: accept draft token d with probability min(1, p(d) / q(d)) (q = 1 for a
    point mass; at temperature 0 iff d is the argmax); on the first rejection draw from
    max(0, p - q) (a point mass: p without d), else a bonus token from the next p."""
    logprobs, p = sampling_distribution(logits, [params] * logits.shape[0])
    tokens = []
    for i, d in enumerate(draft):
        if params.greedy:
            ok = d == int(logits[i].argmax())
        else:
            qd = 1.0 if q is None else float(q[i, d])
            ok = stream.draw() * qd < float(p[i, d])
        if not ok:
            break
        tokens.append(d)
    accepted, row = len(tokens), len(tokens)
    if params.greedy:
        tokens.append(int(logits[row].argmax()))
    else:
        weights = p[row].double().clone()
        if accepted < len(draft):
            if q is None:
                weights[draft[accepted]] = 0.0
            else:
                residual = (weights - q[accepted].double()).clamp(min=0.0)
                if residual.sum() > 0:
                    weights = residual
        u = torch.tensor([stream.draw()], dtype=torch.float64)
        tokens.append(int(draw_from_cdf(weights.cumsum(0).unsqueeze(0), u)))
    lp = [float(logprobs[i, t]) for i, t in enumerate(tokens)]
    return tokens, lp, accepted


def test_batched_verification_is_each_sequence_verified_alone():
    rng = random.Random(0)
    checked = 0
    for case in range(150):
        vocab = rng.choice([5, 7, 50])
        seqs, alone = [], []
        for _ in range(rng.randint(1, 6)):
            kind = rng.choice(["greedy", "plain", "top_k", "top_p"])
            params = SamplingParams(
                temperature=0.0 if kind == "greedy" else rng.choice([0.5, 1.0, 1.3]),
                top_k=3 if kind == "top_k" else -1,
                top_p=0.8 if kind == "top_p" else 1.0,
            )
            k = rng.randint(0, 4)
            draft = [rng.randrange(vocab) for _ in range(k)]
            q = None
            if k and kind != "greedy" and rng.random() < 0.5:
                q = torch.softmax(2 * torch.randn(k, vocab), -1)
            seed, used = rng.randrange(1 << 30), rng.randrange(70)
            streams = UniformStream(seed), UniformStream(seed)
            for s in streams:
                for _ in range(used):
                    s.draw()
            request = types.SimpleNamespace(params=params)
            seqs.append(
                types.SimpleNamespace(
                    request=request, draft=draft, draft_probs=q, uniforms=streams[0]
                )
            )
            alone.append((params, draft, q, streams[1]))
        rows = sum(len(s.draft) + 1 for s in seqs)
        logits = rng.choice([0.5, 3.0]) * torch.randn(rows, vocab)
        start = 0
        for seq, result, (params, draft, q, stream) in zip(seqs, verify(logits, seqs), alone):
            n = len(draft) + 1
            tokens, logprobs, accepted = verify_one(
                logits[start : start + n], params, draft, q, stream
            )
            start += n
            assert (result.tokens, result.num_accepted) == (tokens, accepted), case
            assert result.logprobs == logprobs, case
            assert seq.uniforms.draw() == stream.draw(), f"case {case}: streams diverged"
            checked += 1
    assert checked > 400

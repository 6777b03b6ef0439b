"""Exact verification of drafts (Leviathan et al., 2023).

The target model scores the pending token plus k drafted ones in one forward pass, and `verify`
accepts a prefix of the draft so that the emitted tokens are distributed exactly as if sampled
one by one from the target. With p the target's (temperature-scaled, truncated) distribution at a
position and q the distribution the draft token d was drawn from: accept d with probability
min(1, p(d) / q(d)); on the first rejection draw from max(0, p - q), renormalised; if every draft
is accepted draw one bonus token from the next p. Lookup proposers give point-mass drafts (q =
one-hot on d), for which this is: accept with probability p(d), else draw from p with d removed.
At temperature 0, p is one-hot on the argmax: a draft is accepted iff it equals the greedy token,
so greedy output is unchanged token for token.
"""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING, NamedTuple

import torch

from rollout.config import SamplingParams
from rollout.sampler import draw_from_cdf, truncation_mask

if TYPE_CHECKING:
    from rollout.sequence import Sequence


class Verified(NamedTuple):
    tokens: list[int]  # accepted drafts, then one corrected or bonus token
    logprobs: list[float]  # log_softmax(logits / T) of each, before truncation
    num_accepted: int


def sampling_distribution(
    logits: torch.Tensor, params: list[SamplingParams]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row: (log_softmax(logits / T) over the full vocabulary, the distribution tokens are drawn
    from: softmax(logits / T) truncated by top-k / top-p / min-p and renormalised). Greedy rows use
    T = 1 here (their draw is the argmax)."""
    device = logits.device
    temperature = torch.tensor(
        [p.temperature if not p.greedy else 1.0 for p in params], device=device
    )
    logprobs_all = torch.log_softmax(logits / temperature.to(logits.dtype).unsqueeze(-1), dim=-1)
    probs = logprobs_all.exp()
    top_k = torch.tensor([p.top_k for p in params], device=device)
    top_p = torch.tensor([p.top_p for p in params], device=device)
    min_p = torch.tensor([p.min_p for p in params], device=device)
    truncating = ((top_k > 0) & (top_k < probs.shape[-1])) | (top_p < 1) | (min_p > 0)
    if truncating.any():
        rows = truncating.nonzero().squeeze(-1)
        probs[rows] = probs[rows] * truncation_mask(
            probs[rows], top_k[rows], top_p[rows], min_p[rows]
        )
    return logprobs_all, probs / probs.sum(dim=-1, keepdim=True)


def draw(weights: torch.Tensor, uniforms: list[float]) -> list[int]:
    """One inverse-CDF draw per row of non-negative `weights` [R, V] (need not be normalised), in
    vocabulary order and in float64: the sampler's `draw_from_cdf`."""
    cdf = weights.double().cumsum(dim=-1)
    u = torch.tensor(uniforms, dtype=torch.float64, device=weights.device)
    return draw_from_cdf(cdf, u).tolist()


def verify(logits: torch.Tensor, seqs: list[Sequence]) -> list[Verified]:
    """Exact verification of drafts for a batch of sequences.

    logits: [sum(len(s.draft) + 1), V]; sequence s owns len(s.draft) + 1 consecutive rows, row i
    scoring the token after s.draft[:i]. `s.draft_probs` is the draft's q ([len(draft), V]) or None
    for a point-mass draft. All tensor work is batched over rows; only the accept/reject walk along
    each draft is a Python loop over scalars."""
    device = logits.device
    num_rows = [len(s.draft) + 1 for s in seqs]
    starts = [0, *itertools.accumulate(num_rows)][:-1]
    params = [s.request.params for s in seqs]
    logprobs_all, probs = sampling_distribution(
        logits, [p for p, n in zip(params, num_rows) for _ in range(n)]
    )
    greedy_tokens = logits.argmax(dim=-1).tolist()
    # p(d) and q(d) of every drafted token (q = 1 for point masses).
    draft_rows = [start + i for seq, start in zip(seqs, starts) for i in range(len(seq.draft))]
    draft_tokens = [t for seq in seqs for t in seq.draft]
    p_draft = probs[
        torch.tensor(draft_rows, dtype=torch.int64, device=device),
        torch.tensor(draft_tokens, dtype=torch.int64, device=device),
    ].tolist()
    q_draft = [
        q
        for seq in seqs
        for q in (
            [1.0] * len(seq.draft)
            if seq.draft_probs is None
            else seq.draft_probs[torch.arange(len(seq.draft)), torch.tensor(seq.draft)].tolist()
        )
    ]

    accepted_counts: list[int] = []
    residuals: list[
        tuple[int, torch.Tensor | int | None]
    ] = []  # (row to draw from, what to subtract)
    uniforms: list[float] = []
    k = 0
    for seq, param, start in zip(seqs, params, starts):
        accepted = 0
        for i, token in enumerate(seq.draft):
            if param.greedy:
                ok = token == greedy_tokens[start + i]
            else:  # u < p / q, without dividing
                ok = draw_uniform(seq) * q_draft[k + i] < p_draft[k + i]
            if not ok:
                break
            accepted += 1
        k += len(seq.draft)
        accepted_counts.append(accepted)
        row = start + accepted
        if param.greedy or accepted == len(seq.draft):  # greedy, or a bonus token from the next p
            residuals.append((row, None))
        elif seq.draft_probs is None:  # p without the rejected point-mass draft
            residuals.append((row, seq.draft[accepted]))
        else:  # max(0, p - q)
            residuals.append((row, seq.draft_probs[accepted]))
        uniforms.append(-1.0 if param.greedy else draw_uniform(seq))

    # One batched inverse-CDF draw for every sequence's final token.
    weights = probs[
        torch.tensor([r for r, _ in residuals], dtype=torch.int64, device=device)
    ].double()
    for i, (_, subtract) in enumerate(residuals):
        if isinstance(subtract, int):
            weights[i, subtract] = 0.0
        elif subtract is not None:
            residual = (weights[i] - subtract.to(device=device, dtype=torch.float64)).clamp_(
                min=0.0
            )
            # A rejection implies p(d) < q(d), so some token has p > q; rounding aside.
            if residual.sum() > 0:
                weights[i] = residual
    final = draw(weights, [max(u, 0.0) for u in uniforms])

    results = []
    for seq, param, start, accepted, (row, _), drawn in zip(
        seqs, params, starts, accepted_counts, residuals, final
    ):
        last = greedy_tokens[row] if param.greedy else drawn
        tokens = seq.draft[:accepted] + [last]
        token_rows = torch.arange(start, start + len(tokens), device=device)
        logprobs = logprobs_all[token_rows, torch.tensor(tokens, device=device)].tolist()
        results.append(Verified(tokens, logprobs, accepted))
    return results


def draw_uniform(seq: Sequence) -> float:
    """One uniform in [0, 1) from the sequence's own generator."""
    return seq.uniforms.draw()

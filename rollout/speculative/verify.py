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

The whole batch is verified on the logits' device in padded [sequences, longest draft + 1]
tensors and read back once: each sequence's uniforms are peeked before the walk (the most it can
use) and only those the walk used are then taken from its stream, so the stream advances as if
drawn one at a time.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

import numpy as np
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
    T = 1 here (their draw is the argmax). Which rows truncate is decided from `params` on the
    host: nothing is read back."""
    device, vocab = logits.device, logits.shape[-1]
    # float64 first (the Python floats exactly), then the logits' dtype, as `sample` divides
    temperature = torch.tensor(
        [p.temperature if not p.greedy else 1.0 for p in params], dtype=torch.float64, device=device
    )
    logprobs_all = torch.log_softmax(logits / temperature.to(logits.dtype).unsqueeze(-1), dim=-1)
    probs = logprobs_all.exp()
    # the device test of `rollout.sampler._truncating`, on the host (top-p / min-p in float32)
    rows = [
        i
        for i, p in enumerate(params)
        if 0 < p.top_k < vocab or np.float32(p.top_p) < 1 or np.float32(p.min_p) > 0
    ]
    if rows:
        index = torch.tensor(rows, device=device)
        top_k, top_p, min_p = (
            torch.tensor([getattr(params[i], name) for i in rows], device=device)
            for name in ("top_k", "top_p", "min_p")
        )
        probs[index] = probs[index] * truncation_mask(probs[index], top_k, top_p, min_p)
    return logprobs_all, probs / probs.sum(dim=-1, keepdim=True)


def draw(weights: torch.Tensor, uniforms: list[float]) -> torch.Tensor:
    """One inverse-CDF draw per row of non-negative `weights` [R, V] (need not be normalised), in
    vocabulary order and in float64: the sampler's `draw_from_cdf`. Left on the device."""
    cdf = weights.double().cumsum(dim=-1)
    u = torch.tensor(uniforms, dtype=torch.float64, device=weights.device)
    return draw_from_cdf(cdf, u)


def verify(logits: torch.Tensor, seqs: list[Sequence]) -> list[Verified]:
    """Exact verification of drafts for a batch of sequences.

    logits: [sum(len(s.draft) + 1), V]; sequence s owns len(s.draft) + 1 consecutive rows, row i
    scoring the token after s.draft[:i]. `s.draft_probs` is the draft's q ([len(draft), V]) or None
    for a point-mass draft. Every sequence is walked at once on the device: grid cell (s, i) is
    draft position i of sequence s, padded to the longest draft; one read back at the end."""
    device = logits.device
    # K >= 1: a batch without drafts is verified as one with an empty draft per sequence
    B, K = len(seqs), max(1, *(len(s.draft) for s in seqs))
    lengths = [len(s.draft) for s in seqs]
    starts, total = [], 0
    for n in lengths:
        starts.append(total)
        total += n + 1
    params = [s.request.params for s in seqs]
    greedy_seq = [p.greedy for p in params]
    logprobs_all, probs = sampling_distribution(
        logits, [p for p, n in zip(params, lengths) for _ in range(n + 1)]
    )
    greedy_tokens = logits.argmax(dim=-1)

    def on_device(values, dtype=torch.int64):
        return torch.tensor(values, dtype=dtype, device=device)

    # Cell (s, i) of the [B, K + 1] grid reads logits row start_s + min(i, k_s); padded draft
    # positions hold token 0 and are never accepted.
    rows = on_device([[st + min(i, n) for i in range(K + 1)] for st, n in zip(starts, lengths)])
    drafts = on_device([s.draft + [0] * (K - len(s.draft)) for s in seqs])  # [B, K]
    in_draft = on_device([[i < n for i in range(K)] for n in lengths], torch.bool)
    greedy = on_device(greedy_seq, torch.bool)
    k = on_device(lengths)
    # the most uniforms a sequence's walk can use: one per draft, then one for the last token
    uniforms = on_device(
        [[0.0] * (K + 1) if g else s.uniforms.peek(K + 1) for s, g in zip(seqs, greedy_seq)],
        torch.float64,
    )

    # p(d) and q(d) of every drafted token (q = 1 for point masses), in float64 as the walk
    # compares them.
    p_draft = probs[rows[:, :K], drafts].double()
    q_draft = torch.ones((B, K), dtype=torch.float64, device=device)
    with_q = [j for j, s in enumerate(seqs) if s.draft_probs is not None]
    if with_q:
        q_all = torch.cat([seqs[j].draft_probs for j in with_q])  # [sum of their k, V]
        q_first = [0]
        for j in with_q[:-1]:
            q_first.append(q_first[-1] + lengths[j])
        cells = [(j, i) for j in with_q for i in range(lengths[j])]
        q_rows = on_device([f + i for f, j in zip(q_first, with_q) for i in range(lengths[j])])
        q_tokens = on_device([seqs[j].draft[i] for j, i in cells])
        q_draft[on_device([j for j, _ in cells]), on_device([i for _, i in cells])] = q_all[
            q_rows, q_tokens
        ].double()

    # Greedy: accept iff the draft is the argmax. Sampled: accept iff u < p / q (as u * q < p).
    ok = torch.where(
        greedy.unsqueeze(-1),
        drafts == greedy_tokens[rows[:, :K]],
        uniforms[:, :K] * q_draft < p_draft,
    )
    accepted = (ok & in_draft).long().cumprod(dim=-1).sum(dim=-1)  # [B] leading acceptances
    rejected = (accepted < k) & ~greedy
    last_row = rows.gather(-1, accepted.unsqueeze(-1)).squeeze(-1)

    # The last token's distribution: the next p after a full acceptance (a bonus token); after
    # a rejection p without the rejected point-mass draft, or max(0, p - q) renormalised.
    weights = probs[last_row].double()
    # the rejected position where there is one (else any position of the sequence's draft)
    at = torch.minimum(accepted, (k - 1).clamp(min=0)).unsqueeze(-1)
    rejected_token = drafts.gather(-1, at)
    point_mass = on_device([s.draft_probs is None for s in seqs], torch.bool)
    weights.scatter_(
        -1,
        rejected_token,
        torch.where((rejected & point_mass).unsqueeze(-1), 0.0, weights.gather(-1, rejected_token)),
    )
    if with_q:
        sub = on_device(with_q)
        q_rejected = q_all[on_device(q_first) + at[sub, 0]].double()
        residual = (weights[sub] - q_rejected).clamp_(min=0.0)
        # A rejection implies p(d) < q(d), so some token has p > q; rounding aside.
        use = rejected[sub] & (residual.sum(dim=-1) > 0)
        weights[sub] = torch.where(use.unsqueeze(-1), residual, weights[sub])
    # the uniform after the walk's: index accepted + 1 after a rejection, k after acceptance
    u_last = uniforms.gather(-1, torch.minimum(accepted + 1, k).unsqueeze(-1)).squeeze(-1)
    drawn = draw_from_cdf(weights.cumsum(dim=-1), u_last)
    last = torch.where(greedy, greedy_tokens[last_row], drawn)

    # Emitted tokens: the accepted drafts, then the last token at position `accepted`.
    tokens = torch.cat([drafts, drafts.new_zeros((B, 1))], dim=-1)
    tokens.scatter_(-1, accepted.unsqueeze(-1), last.unsqueeze(-1))
    logprobs = logprobs_all[rows, tokens].double()  # [B, K + 1]
    # The one read back: accepted count, tokens and log-probs per sequence (as float64: ids
    # are far below 2**53).
    host = torch.cat([accepted.unsqueeze(-1).double(), tokens.double(), logprobs], dim=-1).tolist()

    results = []
    for seq, g, n, row in zip(seqs, greedy_seq, lengths, host):
        num = int(row[0])
        if not g:  # the walk used one uniform per accepted draft and the rejected one, then one
            seq.uniforms.skip(min(num + 1, n) + 1)
        count = num + 1
        emitted = [int(t) for t in row[1 : 1 + count]]
        results.append(Verified(emitted, row[2 + K : 2 + K + count], num))
    return results


def draw_uniform(seq: Sequence) -> float:
    """One uniform in [0, 1) from the sequence's own generator."""
    return seq.uniforms.draw()

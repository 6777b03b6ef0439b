"""Opt-in log-prob outputs beyond the sampled token's: the top-k alternatives of every sampled
token (`SamplingParams.top_logprobs`) and the prompt's own log-probs (`prompt_logprobs`).

Computed by the scheduler from the step's logits rows only for the requests that ask, so the
default decode path does no extra work. The distribution is the one the sampled token's log-prob
is taken from: log_softmax(logits / T) over the full vocabulary, before top-k / top-p / min-p
truncation, with T = 1 for greedy rows (as `rollout.sampler.sample` divides); prompt positions
at T = 1.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from rollout.sampler import row_temperature
from rollout.sequence import Request, Sequence, TopLogprobs

if TYPE_CHECKING:
    from rollout.speculative.drafting import Emitted


def top_logprobs(logits: torch.Tensor, temperature: torch.Tensor, k: int) -> list[TopLogprobs]:
    """logits [R, V], temperature [R] float64 (0 = greedy: T = 1) -> per row the k most likely
    (token id, log-prob), descending; log-probs in the logits' dtype, of logits / T with T in
    the logits' dtype (as `rollout.sampler.sample` divides)."""
    t = torch.where(temperature == 0, 1.0, temperature).to(logits.device, logits.dtype)
    t = t.unsqueeze(-1)
    values, ids = torch.log_softmax(logits / t, dim=-1).topk(k, dim=-1)
    return [tuple(zip(i, v)) for i, v in zip(ids.tolist(), values.tolist())]


def top_logprobs_of(
    seqs: list[Sequence], logits: torch.Tensor, spans: list[tuple[int, int]] | None = None
) -> list[list[TopLogprobs]]:
    """Per sequence, the top-k of its logits rows (k its `params.top_logprobs`; [] for one that
    does not ask): row i is `seqs[i]`'s one token, or with `spans` [(first row, count)] per
    sequence, the rows of its `count` tokens in order (speculative verification)."""
    spans = spans or [(i, 1) for i in range(len(seqs))]
    out: list[list[TopLogprobs]] = [[] for _ in seqs]
    asking = [i for i, s in enumerate(seqs) if s.request.params.top_logprobs and spans[i][1]]
    if not asking:
        return out
    rows = torch.tensor(
        [r for i in asking for r in range(spans[i][0], spans[i][0] + spans[i][1])],
        device=logits.device,
    )
    temps = torch.tensor(
        [row_temperature(seqs[i].request.params) for i in asking for _ in range(spans[i][1])],
        dtype=torch.float64,
    )
    k = max(seqs[i].request.params.top_logprobs for i in asking)
    tops = iter(top_logprobs(logits[rows], temps, k))
    for i in asking:
        want = seqs[i].request.params.top_logprobs
        out[i] = [next(tops)[:want] for _ in range(spans[i][1])]
    return out


def prompt_rows(seq: Sequence, start: int, end: int) -> int:
    """Logits rows a prefill chunk [start, end) of `seq` adds for its prompt's log-probs:
    positions [start, min(end, prompt_len - 1)), each scoring the next prompt token (the
    prompt's last position is the sampling row). Decided by the request's parameters and the
    chunk only, so `ModelRunner.prepare` and `Scheduler.finish_step` agree within a step."""
    request = getattr(seq, "request", None)  # a draft model's sequence states carry none
    if request is None or not request.params.prompt_logprobs:
        return 0
    return max(0, min(end, seq.prompt_len - 1) - start)


def record_prompt_logprobs(request: Request, start: int, logits: torch.Tensor, rows: slice) -> None:
    """Positions start, start + 1, ... of `request`'s prompt scored by `logits[rows]`: the log-prob
    of the next prompt token (and its top-k); a position already recorded (a recomputation after
    preemption, or another sample's prefill) is skipped."""
    scores = logits[rows]
    lp = torch.log_softmax(scores, dim=-1)
    count = scores.shape[0]
    targets = torch.tensor(request.prompt[start + 1 : start + 1 + count], device=lp.device)
    chosen = lp.gather(-1, targets.unsqueeze(-1)).squeeze(-1).tolist()
    k = request.params.top_logprobs
    tops = None
    if k and request.prompt_top_logprobs is not None:
        values, ids = lp.topk(k, dim=-1)
        tops = [tuple(zip(i, v)) for i, v in zip(ids.tolist(), values.tolist())]
    recorded = request.prompt_logprobs
    assert recorded is not None
    for j in range(count):
        if start + 1 + j == len(recorded):
            recorded.append(chosen[j])
            if tops is not None:
                request.prompt_top_logprobs.append(tops[j])


class LogprobOutputs:
    """The scheduler's side of the opt-in log-probs: it counts the unfinished requests asking for
    top-k, so a step while there are none computes nothing; prompt log-probs cost nothing unless
    a prefill chunk asks (`prompt_rows`)."""

    def __init__(self):
        self.top_k_requests = 0

    def added(self, request: Request) -> None:
        self.top_k_requests += request.params.top_logprobs > 0

    def finished(self, request: Request) -> None:
        self.top_k_requests -= request.params.top_logprobs > 0

    def prompt_chunk(self, seq: Sequence, num_new: int, logits: torch.Tensor, row: int) -> int:
        """A prefill chunk of `seq` (from its `num_computed`) whose prompt-scoring rows start at
        `row`: recorded; returns how many rows it had."""
        start = seq.num_computed
        if scored := prompt_rows(seq, start, start + num_new):
            record_prompt_logprobs(seq.request, start, logits, slice(row, row + scored))
        return scored

    def sampled(self, seqs: list[Sequence], logits: torch.Tensor) -> None:
        """Each sequence drew one token from its row of `logits`: its top-k, when asked (before
        any of them finishes and is recorded)."""
        if self.top_k_requests:
            for seq, top in zip(seqs, top_logprobs_of(seqs, logits)):
                seq.top_logprobs.extend(top)

    def emitted(
        self,
        emitted: list[Emitted],
        speculated: list[tuple[Sequence, int]],
        logits: torch.Tensor,
    ) -> list[list[TopLogprobs]] | None:
        """Per verified sequence, the top-k of each token it emits (token i from row r + i, r its
        first row), for `Sequence.append`; None when nobody asks."""
        if not emitted or not self.top_k_requests:
            return None
        spans = [(r, len(e.tokens)) for (_, r), e in zip(speculated, emitted)]
        return top_logprobs_of([e.seq for e in emitted], logits, spans)

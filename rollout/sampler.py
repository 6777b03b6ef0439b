"""Token sampling with per-sequence parameters and generators.

The logprob returned for a token is `log_softmax(logits / T)[token]` over the *full* vocabulary,
before top-k / top-p / min-p truncation (T = 1 for greedy). That is the quantity the trainer
recomputes from the same logits, so the two can be compared token for token; truncation only
decides which tokens may be drawn.

Batch invariance: a row's draw depends only on its own logits, parameters and generator. Every
row uses the same procedure (mask in vocabulary order, inverse CDF with one uniform from its own
generator), so a seeded sequence samples the same tokens alone or inside any batch. On the CPU
in float32, rows drawn at a temperature > 0 without truncation (the RL case) take the C kernel
of `rollout.native` (the same procedure in one pass over the row); whether a row does depends on
its own parameters only.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

import numpy as np
import torch

from rollout import native

if TYPE_CHECKING:
    from rollout.config import SamplingParams
    from rollout.sequence import Sequence


class SamplingBatch(NamedTuple):
    # [R] float64 (the request's Python float exactly), 0 = greedy; `sample` divides by it in
    # the logits' dtype, as the trainer divides by the same Python float: a float32 T would
    # put a ~1e-8 relative error into every float64 log-prob at T != 1.
    temperature: torch.Tensor
    top_p: torch.Tensor  # [R] float in (0, 1]
    top_k: torch.Tensor  # [R] int, <= 0 = off
    min_p: torch.Tensor  # [R] float in [0, 1)
    uniforms: torch.Tensor  # [R] float64 in [0, 1), one draw from each row's generator
    # What the host knows of every row from the request parameters, so that `sample` branches
    # on Python flags instead of reading the tensors back (a host sync per read on a device).
    # Each is a fact when True and "not known" when False, so it stays true of any `select`.
    # plain: every row is drawn at a temperature > 0 with no top-k, top-p or min-p at all.
    plain: bool = False
    all_sampled: bool = False  # every temperature > 0 (no greedy row)
    all_greedy: bool = False  # every temperature == 0
    unit_temperature: bool = False  # every temperature == 1
    no_truncation: bool = False  # no row sets top-k, top-p or min-p

    @classmethod
    def of(cls, seqs: list[Sequence]) -> SamplingBatch:
        params = [s.request.params for s in seqs]
        # Greedy rows draw too, so a generator's stream advances one draw per token whatever
        # the temperature (keeps seeded streams simple to reason about). (Through numpy: a
        # float64 array from Python floats, then shared with torch, costs less than
        # torch.tensor of the list.)
        draws = np.array([s.uniforms.draw() for s in seqs], dtype=np.float64)
        uniforms = torch.from_numpy(draws)
        # Requests share parameter objects (the samples of one request, often the requests of
        # one call): compare the settings of the distinct objects only.
        first = params[0] if params else None
        if all(p is first for p in params):  # one object (one request, or one call's params)
            distinct = params[:1]
        else:
            distinct = list({id(p): p for p in params}.values())
        settings = {(row_temperature(p), p.top_p, p.min_p, p.top_k) for p in distinct}
        flags = _host_flags(settings)
        if len(settings) == 1:  # one setting for all (the RL case)
            ((temperature, top_p, min_p, top_k),), rows = settings, len(params)
            return cls(
                temperature=torch.full((rows,), temperature, dtype=torch.float64),
                top_p=torch.full((rows,), top_p, dtype=torch.float32),
                top_k=torch.full((rows,), top_k, dtype=torch.int64),
                min_p=torch.full((rows,), min_p, dtype=torch.float32),
                uniforms=uniforms,
                **flags,
            )
        keys = [(row_temperature(p), p.top_p, p.min_p, p.top_k) for p in params]
        floats = torch.tensor([k[:3] for k in keys], dtype=torch.float32).reshape(-1, 3)
        return cls(
            temperature=torch.tensor([k[0] for k in keys], dtype=torch.float64),
            top_p=floats[:, 1],
            top_k=torch.tensor([k[3] for k in keys], dtype=torch.int64),
            min_p=floats[:, 2],
            uniforms=uniforms,
            **flags,
        )

    def select(self, rows) -> SamplingBatch:
        """The batch of `rows` (an index tensor or a slice)."""
        return self._replace(**{f: getattr(self, f)[rows] for f in _TENSOR_FIELDS})


def row_temperature(params: SamplingParams) -> float:
    """The temperature a row is sampled at: the request's, exactly (a Python float, float64),
    except that a positive T that rounds to 0 in float32 is 0 (greedy), so no dtype the logits
    may have divides by zero."""
    t = float(params.temperature)
    return 0.0 if np.float32(t) == 0 else t


_TENSOR_FIELDS = ("temperature", "top_p", "top_k", "min_p", "uniforms")


def _host_flags(settings: set[tuple[float, float, float, int]]) -> dict[str, bool]:
    """SamplingBatch's host-side flags from the distinct (temperature, top_p, min_p, top_k)
    settings of its rows, compared as `sample` compares the tensors: the temperature in float64
    (its tensor's dtype), top-p and min-p in float32."""
    temperatures = [float(t) for t, *_ in settings]
    no_truncation = all(
        top_k <= 0 and np.float32(top_p) >= 1 and np.float32(min_p) <= 0
        for _, top_p, min_p, top_k in settings
    )
    all_sampled = all(t > 0 for t in temperatures)
    return {
        "plain": bool(all_sampled and no_truncation),
        "all_sampled": bool(all_sampled),
        "all_greedy": bool(all(t == 0 for t in temperatures)),
        "unit_temperature": bool(all(t == 1 for t in temperatures)),
        "no_truncation": bool(no_truncation),
    }


def truncation_mask(
    probs: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor
) -> torch.Tensor:
    """[R, V] bool, True = token may be drawn. Applied in Hugging Face's order: top-k keeps the k
    most likely; top-p then keeps the smallest set of the most likely whose mass *within the top-k
    distribution* reaches p; min-p keeps tokens with prob >= min_p * max (a ratio, so unaffected
    by renormalisation). The most likely token is always kept."""
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    rank = torch.arange(probs.shape[-1], device=probs.device).expand_as(probs)
    k = torch.where(top_k > 0, top_k, probs.shape[-1]).unsqueeze(-1)
    in_top_k = rank < k
    top_k_mass = (sorted_probs * in_top_k).sum(dim=-1, keepdim=True)
    mass_before = (sorted_probs.cumsum(dim=-1) - sorted_probs) / top_k_mass
    keep_sorted = in_top_k & (mass_before < top_p.unsqueeze(-1))
    keep_sorted &= sorted_probs >= min_p.unsqueeze(-1) * sorted_probs[:, :1]
    keep_sorted[:, 0] = True
    return torch.zeros_like(keep_sorted).scatter_(-1, order, keep_sorted)


def draw_from_cdf(cdf: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """One inverse-CDF draw per row: `cdf` [R, V] is the running sum of a row's non-negative
    weights in vocabulary order (they need not be normalised), `uniforms` [R] in [0, 1). The
    draw is the first token whose cumulative mass exceeds u * total (right=True skips
    zero-weight tokens, whose cdf equals their predecessor's). The one draw of the sampler and
    of speculative verification and drafting."""
    threshold = uniforms.to(dtype=cdf.dtype) * cdf[:, -1]
    choice = torch.searchsorted(cdf, threshold.unsqueeze(-1), right=True).squeeze(-1)
    # Rounding can put the threshold at the total (choice == V); then take the last token of
    # positive mass: the first whose cdf reaches the total (a running sum of non-negative
    # numbers never decreases). Otherwise cdf[choice] > threshold >= cdf[choice - 1], so the
    # choice has positive mass already. Selected by `where`, never by reading the rows back.
    last = torch.searchsorted(cdf, cdf[:, -1:].contiguous()).squeeze(-1)
    return torch.where(choice == cdf.shape[-1], last, choice)


def _truncating(top_k, top_p, min_p, vocab: int) -> torch.Tensor:
    """[R] bool: rows whose top-k, top-p or min-p removes any token."""
    return ((top_k > 0) & (top_k < vocab)) | (top_p < 1) | (min_p > 0)


def sample(logits: torch.Tensor, batch: SamplingBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [R, V] float32 or float64 -> (tokens [R] int64, logprobs [R] in the logits' dtype).

    One exponential per logit: with m the row max and e = exp(x / T - m), e feeds the draw
    (inverse CDF over e, truncated; the draw is unchanged by the scale 1 / sum(e)) and its sum
    gives the chosen token's log-prob, x / T - m - log(sum(e)): the formula log_softmax
    evaluates, computed for the chosen tokens only."""
    if logits.dtype == torch.float32 and logits.device.type == "cpu":
        if (lib := native.sampling()) is not None:
            return _sample_native(lib, logits, batch)
    return _sample_torch(logits, batch)


def _sample_native(lib, logits: torch.Tensor, batch: SamplingBatch):
    """Rows drawn at a temperature > 0 without truncation go through the C kernel
    (`rollout.native.sample_rows`, the same procedure in one pass); the others through
    `_sample_torch`. Which path a row takes depends on its own parameters only."""
    if batch.plain:
        return native.sample_rows(lib, logits, batch.temperature, batch.uniforms)
    if batch.all_greedy:
        return _sample_torch(logits, batch)
    # Rows of both kinds, or not known: split them (host tensors; reading them costs no sync).
    plain = (batch.temperature > 0) & ~_truncating(
        batch.top_k, batch.top_p, batch.min_p, logits.shape[-1]
    )
    if bool(plain.all()):
        return native.sample_rows(lib, logits, batch.temperature, batch.uniforms)
    if not bool(plain.any()):
        return _sample_torch(logits, batch)
    tokens = torch.empty(logits.shape[0], dtype=torch.int64)
    logprobs = torch.empty(logits.shape[0], dtype=logits.dtype)
    for rows, fast in (
        (plain.nonzero().squeeze(-1), True),
        ((~plain).nonzero().squeeze(-1), False),
    ):
        part = batch.select(rows)
        if fast:
            tokens[rows], logprobs[rows] = native.sample_rows(
                lib, logits[rows], part.temperature, part.uniforms
            )
        else:
            tokens[rows], logprobs[rows] = _sample_torch(logits[rows], part)
    return tokens, logprobs


def _sample_torch(logits: torch.Tensor, batch: SamplingBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """`sample` in torch ops (any device and dtype; the reference of the C kernel). Reads
    nothing back to the host: it branches on the batch's host-side flags, and rows that do not
    draw (greedy) or do not truncate are masked out with `where`, never indexed out."""
    device = logits.device
    temperature = batch.temperature.to(device)
    greedy = temperature == 0
    # x / 1.0 == x exactly, so skipping the division when every temperature is 1 changes nothing.
    # T is rounded to the logits' dtype (a float64 T would promote float32 logits to float64).
    scaled = (
        logits
        if batch.unit_temperature
        else logits / torch.where(greedy, 1.0, temperature).to(logits.dtype).unsqueeze(-1)
    )
    shifted = scaled - scaled.amax(dim=-1, keepdim=True)  # <= 0, exactly 0 at the max
    weights = shifted.exp()  # the only pass computing exp: e = exp(x / T - m)
    log_total = weights.sum(dim=-1).log_()  # log sum(e) >= 0: the max contributes exactly 1
    if batch.all_greedy:
        tokens = logits.argmax(dim=-1)
    else:
        if not batch.no_truncation:
            # truncation_mask compares ratios of masses (top-p within the top-k mass, min-p to
            # the max), so unnormalised weights select the same tokens as probabilities. Rows
            # that truncate nothing keep every token (the mask's rounding never touches them).
            top_k, top_p, min_p = (t.to(device) for t in (batch.top_k, batch.top_p, batch.min_p))
            truncating = _truncating(top_k, top_p, min_p, weights.shape[-1])
            keep = truncation_mask(weights, top_k, top_p, min_p) | ~truncating.unsqueeze(-1)
            weights.mul_(keep)
        # The weights are a temporary: their cumulative sum is taken in place. Greedy rows draw
        # too (the draw is discarded): one procedure for every row, no row selection.
        drawn = draw_from_cdf(weights.cumsum_(dim=-1), batch.uniforms.to(device))
        tokens = drawn if batch.all_sampled else torch.where(greedy, logits.argmax(dim=-1), drawn)
    logprobs = shifted.gather(-1, tokens.unsqueeze(-1)).squeeze(-1) - log_total
    return tokens, logprobs


def read_back(tokens: torch.Tensor, logprobs: torch.Tensor) -> tuple[list[int], list[float]]:
    """`sample`'s result on the host in one device-to-host read: tokens and log-probs stacked
    as float64 (token ids are far below 2**53, and every float32 log-prob is a float64)."""
    packed = torch.stack((tokens.to(torch.float64), logprobs.to(torch.float64)))
    token_list, logprob_list = packed.tolist()
    return [int(t) for t in token_list], logprob_list

"""Requests, the sequences (samples) they fan out into, and what the engine returns."""

from __future__ import annotations

import enum
import itertools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from rollout.config import SamplingParams
from rollout.radix_cache import RadixCache, TreeNode
from rollout.uniform_stream import UniformStream

# Process-wide and monotonic, so an epoch is never reused, not even by another engine.
_kv_epochs = itertools.count()


# The k most likely tokens at one position, (token id, log-prob) in descending log-prob.
TopLogprobs = tuple[tuple[int, float], ...]


class SampleOutput(NamedTuple):
    token_ids: list[int]
    logprobs: list[float]  # log_softmax(logits / T)[token], before top-p/top-k truncation
    finish_reason: str  # "stop" | "length" | "abort"
    # Per token, the `SamplingParams.top_logprobs` most likely of the same distribution; None
    # unless asked.
    top_logprobs: list[TopLogprobs] | None = None


class RequestOutput(NamedTuple):
    request_id: int
    prompt_token_ids: list[int]
    samples: list[SampleOutput]
    cached_tokens: int = 0  # prompt tokens taken from the prefix cache at first admission
    # Per sample, the engine's weight version that sampled each of its tokens: one version
    # unless a weight update landed while it ran (`Engine.update_weights(keep_running=True)`).
    weight_versions: tuple[list[int], ...] = ()
    # `SamplingParams.prompt_logprobs`: per prompt token its log-prob given the tokens before it
    # (None for the first), and with `top_logprobs` the k most likely at each position; None
    # unless asked.
    prompt_logprobs: list[float | None] | None = None
    prompt_top_logprobs: list[TopLogprobs | None] | None = None
    # Mixture of experts only (None for a dense model): per sample, the top-k expert ids of
    # every sparse layer for each token the engine computed, [tokens, sparse layers, k], tokens
    # = prompt + generated - 1 for a finished sample (an aborted one: those computed). Prefix-
    # cache hits give the routes of the prefill that computed the reused K/V (`rollout.routes`).
    routed_experts: tuple[torch.Tensor, ...] | None = None


# Called with a sample's generated token ids after each appended token; True ends the sample
# with finish_reason "stop" (the token that completed the match is kept). Stop strings live here:
# the engine never decodes text, its caller (the server) owns the tokenizer.
StopCheck = Callable[[list[int]], bool]


class Status(enum.Enum):
    WAITING = "waiting"  # not holding KV (new, or preempted for recompute)
    RUNNING = "running"  # admitted: holds a table row and pages
    FINISHED = "finished"


@dataclass(eq=False)
class Request:
    request_id: int
    prompt: list[int]
    params: SamplingParams
    base_seed: int  # sample j draws from torch.Generator seeded with base_seed + j
    stop_check: StopCheck | None = None
    samples: list[SampleOutput | None] = field(init=False)
    versions: list[list[int]] = field(init=False)  # per sample: see RequestOutput
    routes: list[torch.Tensor | None] = field(init=False)  # per sample: see RequestOutput
    aborted: bool = False
    cached_tokens: int | None = None  # set when its first sequence is admitted
    # Set by `set_limits` (when the scheduler takes the request), read for every sampled token:
    # the ids that end a sample with "stop" (EOS unless ignored, and `stop_token_ids`), and the
    # length (prompt + generated) at which it ends with "length" (max_new_tokens, or the
    # engine's max_model_len).
    stop_ids: frozenset[int] = field(init=False, default=frozenset())
    end_len: int = field(init=False, default=0)
    # `params.prompt_logprobs`: filled in prompt order as prefill chunks compute them (see
    # `RequestOutput`); None unless asked.
    prompt_logprobs: list[float | None] | None = field(init=False, default=None)
    prompt_top_logprobs: list[TopLogprobs | None] | None = field(init=False, default=None)

    def __post_init__(self) -> None:
        self.samples = [None] * self.params.n
        self.versions = [[] for _ in range(self.params.n)]
        self.routes = [None] * self.params.n
        if self.params.prompt_logprobs:
            self.prompt_logprobs = [None]
            if self.params.top_logprobs:
                self.prompt_top_logprobs = [None]

    @property
    def wants_prompt_logprobs(self) -> bool:
        """Whether some prompt log-prob is still to be computed (then the prompt is computed in
        full at admission: no cached prefix is taken)."""
        return self.prompt_logprobs is not None and len(self.prompt_logprobs) < len(self.prompt)

    def set_limits(self, eos_token_ids: frozenset[int], max_model_len: int) -> None:
        params = self.params
        eos = eos_token_ids if not params.ignore_eos else frozenset()
        self.stop_ids = eos | frozenset(params.stop_token_ids)
        self.end_len = min(len(self.prompt) + params.max_new_tokens, max_model_len)

    @property
    def done(self) -> bool:
        return all(s is not None for s in self.samples)

    def record(self, seq: Sequence, reason: str) -> None:
        """`seq` ended: its output, and empty ones for the forks it still stood for."""
        top = list(seq.top_logprobs) if self.params.top_logprobs else None
        out = SampleOutput(seq.token_ids[seq.prompt_len :], list(seq.logprobs), reason, top)
        self.versions[seq.sample_index] = list(seq.versions)
        for j in range(seq.sample_index, seq.sample_index + seq.num_forks):
            empty = SampleOutput([], [], reason, [] if top is not None else None)
            self.samples[j] = out if j == seq.sample_index else empty
            if seq.routes is not None:  # forks that never ran computed nothing
                self.routes[j] = seq.routes if j == seq.sample_index else seq.routes[:0]

    def output(self) -> RequestOutput:
        """What the engine returns once every sample is recorded (`done`)."""
        return RequestOutput(
            self.request_id,
            self.prompt,
            list(self.samples),
            self.cached_tokens or 0,
            tuple(self.versions),
            self.prompt_logprobs,
            self.prompt_top_logprobs,
            None if self.routes[0] is None else tuple(self.routes),
        )


@dataclass(eq=False)
class Sequence:
    """One sample of a request: prompt + generated tokens and the KV it holds.

    KV is valid for `token_ids[:num_computed]`. A decoding sequence has exactly one token
    pending (`num_computed == len(token_ids) - 1`): the one sampled last step. Before its first
    sample, a sequence may stand for `num_forks` samples that share its prompt: when the prompt's
    prefill completes, it forks into that many sequences, each drawing from its own generator.
    """

    request: Request
    sample_index: int
    num_forks: int = 1
    token_ids: list[int] = None  # type: ignore[assignment]  # default: a copy of the prompt
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)  # weight version of each generated token
    # per generated token, with `params.top_logprobs` only (`SampleOutput.top_logprobs`)
    top_logprobs: list[TopLogprobs] = field(default_factory=list)
    status: Status = Status.WAITING
    num_computed: int = 0
    pages: list[int] = field(
        default_factory=list
    )  # page table; the first `num_tree_pages` belong to the tree
    num_tree_pages: int = 0
    node: TreeNode | None = None  # locked radix node covering the tree pages
    # The radix tree `node` belongs to: the scheduler's cache, or one retired by a weight update
    # while this sequence ran (its K/V came from the old weights; never matched again).
    tree: RadixCache | None = None
    row: int | None = None  # row in the slot table while running
    extra_rows: list[int] = field(default_factory=list)  # rows reserved for the forks to come
    draft: list[int] = field(default_factory=list)  # speculated tokens verified this step
    draft_probs: torch.Tensor | None = None  # what `draft` was drawn from; None = point mass
    # Mixture of experts: the routes of its computed tokens, read out when it last gave its
    # pages back (`rollout.routes`); None for a dense model or before then.
    routes: torch.Tensor | None = None
    uniforms: UniformStream = field(init=False)  # this sample's random stream
    # Names one lifetime of this sequence's page table: changes whenever pages are taken,
    # replaced or released otherwise than by appending (admit, prefix-cache insert, preempt,
    # finish). Copies of its K/V kept elsewhere (`SuffixLanes`) are valid only for this epoch.
    kv_epoch: int = field(init=False)
    prompt_len: int = field(init=False)  # len(request.prompt), read every step

    def __post_init__(self) -> None:
        self.prompt_len = len(self.request.prompt)
        if self.token_ids is None:
            self.token_ids = list(self.request.prompt)
        # Seeded on CPU whatever the device, so draws do not depend on where the model runs.
        self.uniforms = UniformStream(self.request.base_seed + self.sample_index)
        self.new_kv_epoch()

    def new_kv_epoch(self) -> None:
        """Call whenever the page table changes other than by appending pages."""
        self.kv_epoch = next(_kv_epochs)

    def append(
        self,
        tokens: list[int],
        logprobs: list[float],
        version: int,
        tops: list[TopLogprobs] | None = None,
    ) -> str | None:
        """Append sampled tokens (and their top-k, when asked) up to the first that ends the
        sample; returns why it ended, if it did."""
        for i, (token, logprob) in enumerate(zip(tokens, logprobs)):
            self.token_ids.append(token)
            self.logprobs.append(logprob)
            self.versions.append(version)
            if tops is not None:
                self.top_logprobs.append(tops[i])
            if (reason := self.finish_reason(token)) is not None:
                return reason
        return None

    def finish_reason(self, token: int) -> str | None:
        """Whether `token`, just appended, ends this sample, and why: the one place that decides
        ("stop": a stop id or the stop check; "length": the request's `end_len`)."""
        request = self.request
        if token in request.stop_ids:
            return "stop"
        if request.stop_check is not None and request.stop_check(self.token_ids[self.prompt_len :]):
            return "stop"
        return "length" if len(self.token_ids) >= request.end_len else None

    @property
    def order(self) -> tuple[int, int]:
        """Arrival order; the largest is the newest (preempted first)."""
        return (self.request.request_id, self.sample_index)

    @property
    def num_generated(self) -> int:
        return len(self.token_ids) - self.prompt_len

    @property
    def private_pages(self) -> list[int]:
        return self.pages[self.num_tree_pages :]

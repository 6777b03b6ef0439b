"""What a prefill engine hands a decode engine: a prompt's K/V and each sample's first token.

Prefill-decode disaggregation splits one request across two engines (`rollout.prefill_decode`):
the prefill engine computes the prompt (reusing its prefix cache) and samples every sample's
first token; the decode engine copies the prompt's K/V into its own pages and samples on. The
handoff carries everything the decode side needs to sample exactly what one engine would have:
the K/V (every KV head, whatever the tensor parallelism of either side; and a mixture's routes)
of every prompt position, each sample's first token and
log-prob, and how many uniforms each sample's stream consumed (its seed is `base_seed + j`, so a
fresh stream that skips them continues it).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from rollout.config import SamplingParams
from rollout.kv_pool import KVPool
from rollout.routes import read_routes
from rollout.sequence import Sequence


class StaleHandoff(ValueError):
    """A handoff prefilled at another weight version than the decode engine's: refused (never
    served across a version boundary); the caller prefills it again."""


class PrefillHandoff(NamedTuple):
    prompt_token_ids: tuple[int, ...]
    base_seed: int  # sample j's uniforms come from base_seed + j
    first_tokens: tuple[int, ...]  # per sample
    first_logprobs: tuple[float, ...]  # per sample, as `SampleOutput.logprobs`
    uniforms_taken: tuple[int, ...]  # per sample: draws its stream consumed for the first token
    k: torch.Tensor  # [layers, the model's kv heads, prompt tokens, head dim], model dtype
    v: torch.Tensor
    routes: torch.Tensor | None  # [prompt tokens, sparse layers, k]; None for a dense model
    weight_version: int  # the prefill engine's; the decode engine must be at the same one
    cached_tokens: int  # prompt tokens the prefill engine took from its prefix cache

    def check(
        self, params: SamplingParams, weight_version: int, kv_heads: int, draft_model: bool
    ) -> None:
        """The user errors of admitting this handoff with `params` on a decode engine at
        `weight_version` whose model has `kv_heads` KV heads, each one line naming what to
        change."""
        check_supported(params)
        if self.k.shape[1] != kv_heads:  # every head, whatever either side's tensor parallelism
            raise ValueError(
                f"the handoff holds K/V of {self.k.shape[1]} KV heads, the decode engine's "
                f"model has {kv_heads}; prefill it on an engine of the same model"
            )
        if draft_model:  # its own K/V of the prompt would be missing
            raise ValueError(
                "a decode engine with speculative_method='draft' cannot admit prefilled "
                "requests yet; use 'ngram' or 'group'"
            )
        if len(self.first_tokens) != params.n:
            raise ValueError(
                f"the handoff holds {len(self.first_tokens)} samples but params.n={params.n}; "
                "give the params it was prefilled with"
            )
        if self.weight_version != weight_version:
            raise StaleHandoff(
                f"the handoff was prefilled at weight version {self.weight_version}, the decode "
                f"engine is at {weight_version}; prefill it again after the update"
            )

    @property
    def nbytes(self) -> int:
        """Bytes of tensor payload (K, V and routes) this handoff moves."""
        tensors = [self.k, self.v] + ([self.routes] if self.routes is not None else [])
        return sum(t.numel() * t.element_size() for t in tensors)


def check_supported(params: SamplingParams) -> None:
    """What prefill-decode disaggregation does not serve yet, refused in one line."""
    if params.top_logprobs or params.prompt_logprobs:
        raise ValueError(
            "prefill-decode disaggregation does not serve top_logprobs or prompt_logprobs yet; "
            "set them to 0 / False"
        )


class HandoffCapture:
    """Collects one prefill request's handoff as its samples finish their first token
    (`Scheduler._finish` calls `take` before the sample's pages go back)."""

    def __init__(self, num_samples: int):
        self.first: list[tuple[int, float, int] | None] = [None] * num_samples
        self.kv: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | None = None

    def take(self, seq: Sequence, pool: KVPool, slot_table: torch.Tensor, read_kv=None) -> None:
        """`read_kv(slots)`: K, V of every KV head (under tensor parallelism gathered from
        every rank); default `pool.read_slots`."""
        prompt_len = seq.prompt_len
        self.first[seq.sample_index] = (
            seq.token_ids[prompt_len],
            seq.logprobs[0],
            seq.uniforms.taken,
        )
        # Forks share the prompt's K/V: the first sample holding pages gives it (a fork that
        # found no page holds none).
        if self.kv is None and seq.row is not None:
            slots = slot_table[seq.row, :prompt_len]
            routes = None
            if pool.routes is not None:
                routes = read_routes(pool.routes, slot_table, seq.row, prompt_len)
            read_kv = read_kv or pool.read_slots
            self.kv = (*read_kv(slots), routes)  # model dtype, also from an FP8 pool

    def handoff(self, prompt: list[int], base_seed: int, version: int, cached: int):
        assert self.kv is not None and all(f is not None for f in self.first), "not finished"
        tokens, logprobs, taken = zip(*self.first)
        k, v, routes = self.kv
        return PrefillHandoff(
            tuple(prompt), base_seed, tokens, logprobs, taken, k, v, routes, version, cached
        )


def transfer(handoff: PrefillHandoff, device: torch.device | str) -> PrefillHandoff:
    """The handoff's tensors on `device` (the decode engine's). On one host between CPU
    processes these are the same tensors, moved through shared memory by whoever carries them
    (`torch.multiprocessing`, Ray's object store); between GPUs a CUDA IPC path belongs here."""
    device = torch.device(device)

    def move(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t.to(device, non_blocking=False)

    return handoff._replace(k=move(handoff.k), v=move(handoff.v), routes=move(handoff.routes))

"""Prefill-decode disaggregation at the engine level: one engine prefills, another decodes.

`prefill(engine, prompts, params)` computes each prompt on a prefill engine (through its radix
cache and continuous batching, as `Engine.generate` does), samples every sample's first token,
and returns a `PrefillHandoff` per prompt (`rollout.handoff`). `transfer(handoff, device)` moves
it to the decode engine's device. `Engine.admit_prefilled(handoff, params)` queues it on a
decode engine, which copies the K/V into its own pages, inserts the prompt into its radix cache
and samples on with continuous batching; its `step()` returns the request's output as for any
other. With the same seeds the outputs (tokens, log-probs, finish reasons, a mixture's routes)
are those of one engine doing both.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence as Seq
from typing import NamedTuple

from rollout.config import SamplingParams
from rollout.engine import Engine, check_request
from rollout.handoff import HandoffCapture, PrefillHandoff, check_supported, transfer
from rollout.sequence import Request

__all__ = ["PendingPrefill", "PrefillHandoff", "prefill", "start_prefill", "transfer"]


class PendingPrefill(NamedTuple):
    """A prefill request queued on an engine (`start_prefill`); `handoff` once it finished."""

    request_id: int
    request: Request
    capture: HandoffCapture

    def handoff(self, engine: Engine) -> PrefillHandoff:
        """The finished request's handoff (the engine forgets its capture). A request aborted
        before its first tokens has none: RuntimeError."""
        engine.scheduler.exports.pop(self.request_id, None)
        if self.capture.kv is None or any(f is None for f in self.capture.first):
            raise RuntimeError(f"prefill request {self.request_id} ended before its first token")
        return self.capture.handoff(
            self.request.prompt,
            self.request.base_seed,
            engine.weight_version,
            self.request.cached_tokens or 0,
        )


def start_prefill(engine: Engine, prompt: Seq[int], params: SamplingParams) -> PendingPrefill:
    """Queue `prompt`'s prefill on `engine` (its first tokens only); the engine's `step()` runs
    it, and returns its output (one token per sample) when the handoff is ready."""
    check_supported(params)
    check_request([int(t) for t in prompt], params, engine)  # the whole request must fit
    request_id = engine.add_request(prompt, dataclasses.replace(params, max_new_tokens=1))
    capture = engine.scheduler.exports[request_id] = HandoffCapture(params.n)
    return PendingPrefill(request_id, engine.scheduler.requests[request_id], capture)


def prefill(
    engine: Engine, prompts: Seq[Seq[int]], params: SamplingParams | Seq[SamplingParams]
) -> list[PrefillHandoff]:
    """On the prefill engine: each prompt computed and every sample's first token sampled;
    result[i] is prompt i's handoff. The prompts' K/V stays in the engine's prefix cache."""
    if isinstance(params, SamplingParams):
        params = [params] * len(prompts)
    if len(params) != len(prompts):
        raise ValueError(
            f"got {len(params)} SamplingParams for {len(prompts)} prompts; give one or one per "
            "prompt"
        )
    pending = []
    try:
        for prompt, sp in zip(prompts, params):
            pending.append(start_prefill(engine, prompt, sp))
        left = {p.request_id for p in pending}
        while left:
            left.difference_update(out.request_id for out in engine.step())
    finally:
        for p in pending:
            engine.scheduler.exports.pop(p.request_id, None)
    return [p.handoff(engine) for p in pending]

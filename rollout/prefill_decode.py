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

from rollout.config import SamplingParams
from rollout.engine import Engine, check_request
from rollout.handoff import HandoffCapture, PrefillHandoff, check_supported, transfer

__all__ = ["PrefillHandoff", "prefill", "transfer"]


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
    scheduler = engine.scheduler
    ids = []
    for prompt, sp in zip(prompts, params):
        check_supported(sp, tp=engine.tp is not None)
        check_request([int(t) for t in prompt], sp, engine)  # the whole request must fit
        request_id = engine.add_request(prompt, dataclasses.replace(sp, max_new_tokens=1))
        scheduler.exports[request_id] = HandoffCapture(sp.n)
        ids.append(request_id)
    requests = {i: scheduler.requests[i] for i in ids}
    done: set[int] = set()
    try:
        while len(done) < len(ids):
            done.update(out.request_id for out in engine.step() if out.request_id in requests)
    finally:
        captures = {i: scheduler.exports.pop(i) for i in ids}
    return [
        captures[i].handoff(
            requests[i].prompt,
            requests[i].base_seed,
            engine.weight_version,
            requests[i].cached_tokens or 0,
        )
        for i in ids
    ]

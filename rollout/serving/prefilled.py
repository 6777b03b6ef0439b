"""The endpoint's requests under prefill-decode disaggregation: prefilled elsewhere, decoded here.

An engine server given a `Prefill` (`build_app(..., prefill=)`: an async callable returning a
prompt's `PrefillHandoff` from a prefill engine, e.g. another engine actor) decodes each request
from that handoff (`AsyncEngine.stream(..., handoff=)`) instead of computing the prompt itself;
with the same seeds the tokens are those one engine samples (`rollout.prefill_decode`). What
prefill-decode does not serve yet (`rollout.handoff.check_supported`: top log-probs, prompt
log-probs) is served whole by this engine. Without a `Prefill` both functions are the engine's
own `generate` / `stream`.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable

from rollout.async_engine import AsyncEngine, GenerationResult, TokenDelta
from rollout.config import SamplingParams
from rollout.handoff import PrefillHandoff
from rollout.sequence import StopCheck

Prefill = Callable[[list[int], SamplingParams], Awaitable[PrefillHandoff]]


def decoded_here(prefill: Prefill | None, params: SamplingParams) -> bool:
    """Whether this engine computes the request whole (no prefill engine, or one it cannot
    use for these params)."""
    return prefill is None or bool(params.top_logprobs) or bool(params.prompt_logprobs)


async def stream(
    async_engine: AsyncEngine,
    prefill: Prefill | None,
    prompt_ids: list[int],
    params: SamplingParams,
    stop_check: StopCheck | None,
) -> AsyncIterator[TokenDelta | GenerationResult]:
    """`AsyncEngine.stream`, the prompt prefilled by `prefill` where it serves the request."""
    handoff = None
    if not decoded_here(prefill, params):
        handoff = await prefill(prompt_ids, params)
    async for item in async_engine.stream(prompt_ids, params, stop_check, handoff=handoff):
        yield item


async def generate(
    async_engine: AsyncEngine,
    prefill: Prefill | None,
    prompt_ids: list[int],
    params: SamplingParams,
    stop_check: StopCheck | None,
) -> GenerationResult:
    """`AsyncEngine.generate`, the prompt prefilled by `prefill` where it serves the request."""
    if decoded_here(prefill, params):
        return await async_engine.generate(prompt_ids, params, stop_check)
    items = stream(async_engine, prefill, prompt_ids, params, stop_check)
    try:
        async for item in items:
            if isinstance(item, GenerationResult):
                return item
    finally:
        await items.aclose()  # a cancelled caller aborts the request (the stream's own rule)
    raise RuntimeError("the stream ended without its result (engine bug)")

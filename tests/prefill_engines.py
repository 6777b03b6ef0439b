"""A prefill engine in this process for an engine server under prefill-decode disaggregation
(`rollout.serving.prefilled`): the test suites of the endpoint run once with each request served
by one engine and once with its prompt prefilled by another engine (same weights) and decoded
by the served one."""

from __future__ import annotations

import asyncio

from rollout.async_engine import AsyncEngine

MODES = ("one_engine", "prefill_decode")


def prefill_on(prefill_engine: AsyncEngine):
    """The `build_app(..., prefill=)` hook: each prompt prefilled on `prefill_engine`."""

    async def prefill(prompt_ids, params):
        (future,) = prefill_engine.submit_prefill([(prompt_ids, params)])
        return await asyncio.wrap_future(future)

    return prefill

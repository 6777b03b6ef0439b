"""The engine endpoint's routes: `/v1/completions`, `/v1/chat/completions`, `/v1/models`,
`/health`. Each handler reaches the engine through `ServingState`, the app's state
(`request.app.state.serving`, set by `rollout.serving.server.build_app`).

Every request goes through one `AsyncEngine`, so concurrent clients are continuously batched by
the engine's own step loop. While the engine is paused (weights or memory are being changed)
every generation answers 503. A bad request answers 4xx naming the field.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Request

from rollout.async_engine import AsyncEngine, EngineUnavailable, GenerationResult
from rollout.config import SamplingParams
from rollout.serving.openai_api import (
    PAUSED_MESSAGE,
    APIError,
    ChatRequest,
    CompletionRequest,
    SamplingRequest,
    chat_response,
    completion_response,
    error_response,
    tokenize_prompts,
)
from rollout.stop_strings import make_stop_check


@dataclass(frozen=True)
class ServingState:
    """What the routes serve: the engine, its tokenizer (None: token ids only) and limits."""

    async_engine: AsyncEngine
    tokenizer: Any
    model_name: str
    max_len: int  # the context, prompt + completion
    max_n: int  # samples per request

    @classmethod
    def of(cls, async_engine: AsyncEngine, tokenizer, model_name: str) -> ServingState:
        engine = async_engine.engine
        return cls(
            async_engine,
            tokenizer,
            model_name,
            engine.max_model_len,
            engine.config.max_running_requests,
        )


def serving_state(request: Request) -> ServingState:
    return request.app.state.serving


Serving = Annotated[ServingState, Depends(serving_state)]
engine_routes = APIRouter()


@engine_routes.get("/health")
async def health(state: Serving):
    if not state.async_engine.is_open:
        return error_response(503, PAUSED_MESSAGE, type="service_unavailable")
    return {"status": "ok", "weight_version": state.async_engine.engine.weight_version}


@engine_routes.get("/v1/models")
async def models(state: Serving):
    return {
        "object": "list",
        "data": [
            {
                "id": state.model_name,
                "object": "model",
                "created": 0,
                "owned_by": "miles_like",
                "max_model_len": state.max_len,
            }
        ],
    }


@engine_routes.post("/v1/completions")
async def completions(req: CompletionRequest, state: Serving):
    prompts = tokenize_prompts(req.prompt, state.tokenizer)
    params, stops = sampling_params(state, req, prompts, "prompt", req.max_tokens or 16)
    results = await generate(state, prompts, params, stops, "prompt")
    return completion_response(
        results, state.model_name, state.tokenizer, stops, req.logprobs is not None
    )


@engine_routes.post("/v1/chat/completions")
async def chat_completions(req: ChatRequest, state: Serving):
    if state.tokenizer is None:
        raise APIError(
            400,
            "chat needs a tokenizer with a chat template and this server has "
            "none; use /v1/completions with token ids",
            "messages",
        )
    try:
        prompt = list(
            state.tokenizer.apply_chat_template(
                req.messages,
                tools=req.tools,
                add_generation_prompt=True,
                tokenize=True,
                return_dict=False,
            )
        )
    except Exception as exc:  # noqa: BLE001 -- a template error is the request's fault
        raise APIError(
            400, f"messages could not be rendered by the chat template: {exc}", "messages"
        ) from None
    params, stops = sampling_params(
        state, req, [prompt], "messages", req.max_completion_tokens or req.max_tokens
    )
    (result,) = await generate(state, [prompt], params, stops, "messages")
    return chat_response(result, state.model_name, state.tokenizer, stops, req.logprobs)


def sampling_params(
    state: ServingState,
    req: SamplingRequest,
    prompts: list[list[int]],
    prompt_field: str,
    max_tokens: int | None,
) -> tuple[SamplingParams, list[str]]:
    """The request's engine parameters and stop strings, checked against this server."""
    if req.model != state.model_name:
        raise APIError(
            404,
            f"model {req.model!r} does not exist; this server serves {state.model_name!r}",
            "model",
            code="model_not_found",
        )
    if req.n > state.max_n:
        raise APIError(400, f"n={req.n} exceeds this server's limit of {state.max_n}", "n")
    max_len = state.max_len
    longest = max(len(p) for p in prompts)
    if longest >= max_len:
        raise APIError(
            400,
            f"{prompt_field} has {longest} tokens; the context is {max_len} tokens: shorten it",
            prompt_field,
        )
    if max_tokens is None:
        max_tokens = max_len - longest
    if longest + max_tokens > max_len:
        raise APIError(
            400,
            f"max_tokens={max_tokens} + {longest} prompt tokens exceeds the "
            f"context of {max_len} tokens; lower max_tokens",
            "max_tokens",
        )
    stops = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    if stops and state.tokenizer is None:
        raise APIError(
            400, "stop strings need a tokenizer and this server has none; drop `stop`", "stop"
        )
    try:
        params = SamplingParams(
            n=req.n,
            temperature=req.temperature,
            top_p=req.top_p,
            top_k=req.top_k,
            max_new_tokens=max_tokens,
            seed=req.seed,
            ignore_eos=req.ignore_eos,
        )
    except ValueError as exc:
        raise APIError(400, str(exc)) from None
    return params, stops


async def generate(
    state: ServingState,
    prompts: list[list[int]],
    params: SamplingParams,
    stops: list[str],
    prompt_field: str,
) -> list[GenerationResult]:
    """Every prompt through the engine, concurrently; engine errors as API errors."""
    check = make_stop_check(state.tokenizer, stops) if stops else None
    try:  # a cancelled handler aborts its requests in the engine (AsyncEngine.generate)
        return list(
            await asyncio.gather(*(state.async_engine.generate(p, params, check) for p in prompts))
        )
    except EngineUnavailable as exc:
        raise APIError(
            503,
            PAUSED_MESSAGE if "updating" in str(exc) else str(exc),
            type="service_unavailable",
        ) from None
    except ValueError as exc:  # the engine's check of this request (ids, KV capacity)
        raise APIError(400, str(exc), prompt_field) from None

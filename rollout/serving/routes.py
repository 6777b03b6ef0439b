"""The engine endpoint's routes: `/v1/completions`, `/v1/chat/completions` (both streamed with
`stream: true`: `rollout.serving.streaming`), `/v1/models`, `/tokenize`, `/detokenize`,
`/metrics` (Prometheus text: `rollout.serving.metrics`), `/health`. Each handler reaches the
engine through `ServingState`, the app's state (`request.app.state.serving`, set by
`rollout.serving.server.build_app`).

Every request goes through one `AsyncEngine`, so concurrent clients are continuously batched by
the engine's own step loop. While the engine is paused (weights or memory are being changed)
every generation answers 503. A bad request answers 4xx naming the field.
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass, field
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import PlainTextResponse, StreamingResponse

from rollout.async_engine import AsyncEngine, EngineUnavailable, GenerationResult
from rollout.config import SamplingParams
from rollout.serving import prefilled
from rollout.serving.metrics import ServingMetrics, prometheus_text
from rollout.serving.openai_api import (
    PAUSED_MESSAGE,
    APIError,
    ChatRequest,
    CompletionRequest,
    DetokenizeRequest,
    SamplingRequest,
    TokenizeRequest,
    chat_response,
    completion_response,
    error_response,
    tokenize_prompts,
)
from rollout.serving.streaming import ChatStream, CompletionStream, merged, sse
from rollout.stop_strings import decode, make_stop_check


@dataclass(frozen=True)
class ServingState:
    """What the routes serve: the engine, its tokenizer (None: token ids only) and limits."""

    async_engine: AsyncEngine
    tokenizer: Any
    model_name: str
    max_len: int  # the context, prompt + completion
    max_n: int  # samples per request
    metrics: ServingMetrics = field(default_factory=ServingMetrics)
    prefill: prefilled.Prefill | None = None  # prefill-decode: where prompts are computed

    @classmethod
    def of(
        cls, async_engine: AsyncEngine, tokenizer, model_name: str, prefill=None
    ) -> ServingState:
        engine = async_engine.engine
        return cls(
            async_engine,
            tokenizer,
            model_name,
            engine.max_model_len,
            engine.config.max_running_requests,
            prefill=prefill,
        )


async def serving_state(request: Request) -> ServingState:
    # async: FastAPI runs a plain function dependency in a worker thread, once per request
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


@engine_routes.get("/metrics")
async def metrics(state: Serving):
    text = prometheus_text(state.async_engine.stats(), state.metrics, state.model_name)
    return PlainTextResponse(text, media_type="text/plain; version=0.0.4; charset=utf-8")


@engine_routes.post("/tokenize")
async def tokenize(req: TokenizeRequest, state: Serving):
    """vLLM's `/tokenize`: a text `prompt` or chat `messages` as the engine would see them."""
    check_model(state, req.model)
    if state.tokenizer is None:
        raise APIError(400, "this server has no tokenizer to tokenize with", "prompt")
    if (req.prompt is None) == (req.messages is None):
        raise APIError(400, "give exactly one of `prompt` or `messages`", "prompt")
    if req.prompt is not None:
        tokens = state.tokenizer.encode(req.prompt, add_special_tokens=req.add_special_tokens)
    else:
        tokens = chat_prompt(state, req.messages, req.tools, req.add_generation_prompt)
    return {"count": len(tokens), "max_model_len": state.max_len, "tokens": list(tokens)}


@engine_routes.post("/detokenize")
async def detokenize(req: DetokenizeRequest, state: Serving):
    check_model(state, req.model)
    if state.tokenizer is None:
        raise APIError(400, "this server has no tokenizer to detokenize with", "tokens")
    vocab = state.async_engine.engine.model_config.vocab_size
    if any(t >= vocab for t in req.tokens):
        raise APIError(400, f"tokens has ids outside the vocabulary [0, {vocab})", "tokens")
    return {"prompt": decode(state.tokenizer, req.tokens)}


@engine_routes.post("/v1/completions")
async def completions(req: CompletionRequest, state: Serving):
    prompts = tokenize_prompts(req.prompt, state.tokenizer)
    if req.echo and req.stream:
        raise APIError(400, "echo is not supported with stream=true; drop one of them", "echo")
    params, stops = sampling_params(
        state,
        req,
        prompts,
        "prompt",
        req.max_tokens or 16,
        top_logprobs=req.logprobs or 0,
        prompt_logprobs=req.echo and req.logprobs is not None,
    )
    if req.stream:
        builder = CompletionStream(
            state.model_name, state.tokenizer, stops, req.n, req.logprobs, _include_usage(req)
        )
        return await stream(state, prompts, params, stops, "prompt", builder)
    results = await generate(state, prompts, params, stops, "prompt")
    return completion_response(
        results, state.model_name, state.tokenizer, stops, req.logprobs, req.echo
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
    if req.top_logprobs and not req.logprobs:
        raise APIError(400, "top_logprobs needs logprobs=true", "top_logprobs")
    prompt = chat_prompt(state, req.messages, req.tools, True)
    params, stops = sampling_params(
        state,
        req,
        [prompt],
        "messages",
        req.max_completion_tokens or req.max_tokens,
        top_logprobs=req.top_logprobs or 0,
    )
    if req.stream:
        builder = ChatStream(
            state.model_name,
            state.tokenizer,
            stops,
            req.logprobs,
            bool(req.tools),
            _include_usage(req),
        )
        return await stream(state, [prompt], params, stops, "messages", builder)
    (result,) = await generate(state, [prompt], params, stops, "messages")
    return chat_response(result, state.model_name, state.tokenizer, stops, req.logprobs)


def chat_prompt(state: ServingState, messages, tools, add_generation_prompt: bool) -> list[int]:
    """`messages` through the tokenizer's chat template, as token ids."""
    try:
        return list(
            state.tokenizer.apply_chat_template(
                messages,
                tools=tools,
                add_generation_prompt=add_generation_prompt,
                tokenize=True,
                return_dict=False,
            )
        )
    except Exception as exc:  # noqa: BLE001 -- a template error is the request's fault
        raise APIError(
            400, f"messages could not be rendered by the chat template: {exc}", "messages"
        ) from None


def _include_usage(req: SamplingRequest) -> bool:
    return req.stream_options is not None and req.stream_options.include_usage


def check_model(state: ServingState, model: str | None) -> None:
    if model is not None and model != state.model_name:
        raise APIError(
            404,
            f"model {model!r} does not exist; this server serves {state.model_name!r}",
            "model",
            code="model_not_found",
        )


def sampling_params(
    state: ServingState,
    req: SamplingRequest,
    prompts: list[list[int]],
    prompt_field: str,
    max_tokens: int | None,
    top_logprobs: int = 0,
    prompt_logprobs: bool = False,
) -> tuple[SamplingParams, list[str]]:
    """The request's engine parameters and stop strings, checked against this server."""
    check_model(state, req.model)
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
            top_logprobs=top_logprobs,
            prompt_logprobs=prompt_logprobs,
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
    with engine_errors(prompt_field):  # a cancelled handler aborts its requests in the engine
        results = list(
            await asyncio.gather(
                *(
                    prefilled.generate(state.async_engine, state.prefill, p, params, check)
                    for p in prompts
                )
            )
        )
    state.metrics.served(results)
    return results


async def stream(
    state: ServingState,
    prompts: list[list[int]],
    params: SamplingParams,
    stops: list[str],
    prompt_field: str,
    builder: CompletionStream | ChatStream,
) -> StreamingResponse:
    """Every prompt through the engine as a stream of server-sent events. The first tokens are
    awaited here, so a refused request (paused engine, bad ids) still answers 4xx / 503 before
    the response starts; a client gone mid-stream aborts its requests."""
    check = make_stop_check(state.tokenizer, stops) if stops else None
    items = merged(
        [prefilled.stream(state.async_engine, state.prefill, p, params, check) for p in prompts]
    )
    with engine_errors(prompt_field):
        try:
            first = await anext(items)
        except BaseException:
            await items.aclose()
            raise

    def finish(results: list[GenerationResult]) -> list[dict[str, Any]]:
        state.metrics.served(results)
        return builder.finish(results)

    events = sse(first, items, builder.chunk_of, finish, len(prompts))
    return StreamingResponse(events, media_type="text/event-stream")


@contextlib.contextmanager
def engine_errors(prompt_field: str):
    """Engine errors as API errors: paused or closed -> 503; the engine's check of the request
    (ids, KV capacity) -> 400 naming the prompt's field."""
    try:
        yield
    except EngineUnavailable as exc:
        raise APIError(
            503,
            PAUSED_MESSAGE if "updating" in str(exc) else str(exc),
            type="service_unavailable",
        ) from None
    except ValueError as exc:
        raise APIError(400, str(exc), prompt_field) from None

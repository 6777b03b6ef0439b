"""OpenAI's API shapes, as the engine's endpoint speaks them: request bodies (pydantic: every
field we read typed and range-checked), errors (`{"error": {message, type, param, code}}`, one
naming the field), and the response bodies, built from `GenerationResult`s.

Token in, token out: every choice carries the exact `prompt_token_ids` and completion `token_ids`
the engine saw and sampled; a response carries the `weight_version` that sampled them and
`usage.prompt_tokens_details.cached_tokens` (prompt tokens taken from the prefix cache).
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Annotated, Any, Literal

from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt

from rollout.async_engine import GenerationResult
from rollout.chat import ToolCallError, parse_tool_calls
from rollout.stop_strings import cut_at_stop, decode

PAUSED_MESSAGE = "engine is updating weights; retry"
MAX_LOGPROBS = 0  # only the sampled token's log-prob (engine semantics); no top-k alternatives


# -- errors ------------------------------------------------------------------------------------
class APIError(Exception):
    """A request error: answered as OpenAI's `{"error": {message, type, param, code}}`."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        type: str = "invalid_request_error",
        code: str | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.param, self.type, self.code = (
            status,
            message,
            param,
            type,
            code,
        )

    def response(self) -> JSONResponse:
        return error_response(self.status, self.message, self.param, self.type, self.code)


def error_response(
    status: int,
    message: str,
    param: str | None = None,
    type: str = "invalid_request_error",
    code: str | None = None,
) -> JSONResponse:
    return JSONResponse(
        status_code=status,
        content={"error": {"message": message, "type": type, "param": param, "code": code}},
    )


def validation_error(exc: RequestValidationError) -> JSONResponse:
    """pydantic's first error as one OpenAI-shaped 400 naming the field."""
    err = exc.errors()[0]
    if err.get("type") == "json_invalid":
        return error_response(400, f"request body is not valid JSON: {err.get('msg')}")
    loc = [str(p) for p in err.get("loc", ()) if p != "body"]
    field = loc[0] if loc else None  # the top-level field (deeper parts name union members)
    return error_response(400, f"{field or 'request body'}: {err.get('msg')}", field)


# -- request bodies ----------------------------------------------------------------------------
NonNegInt = Annotated[StrictInt, Field(ge=0)]


class SamplingRequest(BaseModel):
    """The fields completions and chat share."""

    # Unknown fields are accepted and ignored, as OpenAI-compatible servers do (clients send
    # e.g. `user`); every field we read is typed and range-checked.
    model_config = ConfigDict(extra="allow")

    model: str
    n: StrictInt = Field(1, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    max_tokens: StrictInt | None = Field(None, ge=1)
    stop: str | list[str] | None = None
    seed: StrictInt | None = None
    # extra fields (not in OpenAI's API)
    top_k: StrictInt = Field(-1, ge=-1)
    ignore_eos: StrictBool = False
    session_id: str | None = None  # for the router; ignored here
    stream: Literal[False] = False  # not supported: refused by name, never silently ignored


class CompletionRequest(SamplingRequest):
    prompt: str | list[NonNegInt] | list[str] | list[list[NonNegInt]]
    logprobs: StrictInt | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: Literal[False] = False


class ChatRequest(SamplingRequest):
    messages: list[dict[str, Any]] = Field(min_length=1)
    tools: list[dict[str, Any]] | None = None
    logprobs: StrictBool = False
    top_logprobs: StrictInt | None = Field(None, ge=0, le=MAX_LOGPROBS)
    max_completion_tokens: StrictInt | None = Field(None, ge=1)


def tokenize_prompts(prompt, tokenizer) -> list[list[int]]:
    """`prompt` (text, token ids, or a list of either) as a list of token-id prompts."""
    if isinstance(prompt, str) or (prompt and isinstance(prompt[0], str)):
        if tokenizer is None:
            raise APIError(
                400, "this server has no tokenizer: give `prompt` as token ids", "prompt"
            )
        texts = [prompt] if isinstance(prompt, str) else prompt
        prompts = [tokenizer.encode(t, add_special_tokens=False) for t in texts]
    elif prompt and isinstance(prompt[0], list):
        prompts = prompt
    else:
        prompts = [prompt]
    if not prompts or any(len(p) == 0 for p in prompts):
        raise APIError(400, "prompt is empty; give at least one token", "prompt")
    return [list(p) for p in prompts]


# -- response bodies ---------------------------------------------------------------------------
def completion_response(
    results: list[GenerationResult], model_name: str, tokenizer, stops: list[str], logprobs: bool
) -> dict[str, Any]:
    """`/v1/completions`: one choice per sample of every prompt, in order."""
    choices = []
    for r in results:
        for s in r.samples:
            text, reason = _text_of(tokenizer, s.token_ids, stops, s.finish_reason)
            choice = {
                "index": len(choices),
                "text": text,
                "finish_reason": reason,
                "logprobs": None,
                "prompt_token_ids": r.prompt_token_ids,
                "token_ids": s.token_ids,
            }
            if logprobs:
                pieces = _token_strings(tokenizer, s.token_ids)
                offsets = [sum(len(p) for p in pieces[:i]) for i in range(len(pieces))]
                choice["logprobs"] = {
                    "tokens": pieces,
                    "token_logprobs": s.logprobs,
                    "top_logprobs": None,
                    "text_offset": offsets,
                }
            choices.append(choice)
    return {
        "id": f"cmpl-{uuid.uuid4().hex}",
        "object": "text_completion",
        "created": int(time.time()),
        "model": model_name,
        "choices": choices,
        "usage": _usage(results),
        "weight_version": results[0].weight_version,
    }


def chat_response(
    result: GenerationResult, model_name: str, tokenizer, stops: list[str], logprobs: bool
) -> dict[str, Any]:
    """`/v1/chat/completions`: one choice per sample, its message parsed for tool calls."""
    choices = []
    for s in result.samples:
        text, reason = _text_of(tokenizer, s.token_ids, stops, s.finish_reason)
        message = chat_message(text)
        if message.get("tool_calls") and reason == "stop":
            reason = "tool_calls"
        choice = {
            "index": len(choices),
            "message": message,
            "finish_reason": reason,
            "logprobs": None,
            "prompt_token_ids": result.prompt_token_ids,
            "token_ids": s.token_ids,
        }
        if logprobs:
            choice["logprobs"] = {
                "content": [
                    {
                        "token": piece,
                        "logprob": lp,
                        "bytes": list(piece.encode()),
                        "top_logprobs": [],
                    }
                    for piece, lp in zip(_token_strings(tokenizer, s.token_ids), s.logprobs)
                ]
            }
        choices.append(choice)
    return {
        "id": f"chatcmpl-{uuid.uuid4().hex}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model_name,
        "choices": choices,
        "usage": _usage([result]),
        "weight_version": result.weight_version,
    }


def chat_message(text: str) -> dict[str, Any]:
    """The assistant message of a sampled turn: its content and, in the template's tool-call
    layout (`rollout.chat`), its tool calls with JSON-string arguments as OpenAI sends them. A
    malformed call is not an error of the request: the text is returned as content, uncut."""
    try:
        content, calls = parse_tool_calls(text)
    except ToolCallError:
        return {"role": "assistant", "content": text}
    if not calls:
        return {"role": "assistant", "content": content}
    return {
        "role": "assistant",
        "content": content or None,
        "tool_calls": [
            {
                "id": f"call_{uuid.uuid4().hex[:24]}",
                "type": "function",
                "function": {
                    "name": c.name,
                    "arguments": json.dumps(c.arguments, ensure_ascii=False),
                },
            }
            for c in calls
        ],
    }


def _text_of(tokenizer, sample_ids: list[int], stops: list[str], reason: str) -> tuple[str, str]:
    """A sample's text, cut before a stop string (its finish reason then "stop"); without a
    tokenizer, empty."""
    if tokenizer is None:
        return "", reason
    text, cut = cut_at_stop(decode(tokenizer, sample_ids), stops)
    return text, "stop" if cut else reason


def _token_strings(tokenizer, ids: list[int]) -> list[str]:
    return [decode(tokenizer, [t]) for t in ids] if tokenizer is not None else [""] * len(ids)


def _usage(results: list[GenerationResult]) -> dict[str, Any]:
    prompt = sum(len(r.prompt_token_ids) for r in results)
    completion = sum(len(s.token_ids) for r in results for s in r.samples)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": sum(r.cached_tokens for r in results)},
    }

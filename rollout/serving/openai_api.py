"""OpenAI's API shapes, as the engine's endpoint speaks them: request bodies (pydantic: every
field we read typed and range-checked), errors (`{"error": {message, type, param, code}}`, one
naming the field), and the response bodies, built from `GenerationResult`s.

Token in, token out: every choice carries the exact `prompt_token_ids` and completion `token_ids`
the engine saw and sampled; a response carries the `weight_version` that sampled them and
`usage.prompt_tokens_details.cached_tokens` (prompt tokens taken from the prefix cache).

Log-probs: each token's is the engine's own (log_softmax(logits / T) before truncation); the
alternatives (`logprobs=k` on completions, `top_logprobs=k` on chat, k <= 20) are the engine's
top-k of the same distribution (`SamplingParams.top_logprobs`), keyed by their text. Streamed
responses are built by `rollout.serving.streaming`.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Annotated, Any

from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt

from rollout.async_engine import GenerationResult
from rollout.chat import ToolCallError, parse_tool_calls
from rollout.stop_strings import cut_at_stop, decode

PAUSED_MESSAGE = "engine is updating weights; retry"
MAX_LOGPROBS = 20  # most top-k alternatives per token (`SamplingParams.top_logprobs`)


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


class StreamOptions(BaseModel):
    include_usage: StrictBool = False  # a last chunk with the usage (and no choices)


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
    stream: StrictBool = False  # server-sent events (`rollout.serving.streaming`)
    stream_options: StreamOptions | None = None


class CompletionRequest(SamplingRequest):
    prompt: str | list[NonNegInt] | list[str] | list[list[NonNegInt]]
    logprobs: StrictInt | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: StrictBool = False  # the prompt before the completion (with its log-probs, if asked)


class ChatRequest(SamplingRequest):
    messages: list[dict[str, Any]] = Field(min_length=1)
    tools: list[dict[str, Any]] | None = None
    logprobs: StrictBool = False
    top_logprobs: StrictInt | None = Field(None, ge=0, le=MAX_LOGPROBS)
    max_completion_tokens: StrictInt | None = Field(None, ge=1)


class TokenizeRequest(BaseModel):
    """vLLM's `/tokenize`: a text `prompt`, or chat `messages` through the chat template."""

    model: str | None = None
    prompt: str | None = None
    add_special_tokens: StrictBool = True
    messages: list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    add_generation_prompt: StrictBool = True


class DetokenizeRequest(BaseModel):
    model: str | None = None
    tokens: list[NonNegInt]


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
    results: list[GenerationResult],
    model_name: str,
    tokenizer,
    stops: list[str],
    logprobs: int | None,
    echo: bool = False,
) -> dict[str, Any]:
    """`/v1/completions`: one choice per sample of every prompt, in order. `logprobs`: None (no
    log-probs), 0 (the tokens' own) or k (and the top k of each position); `echo`: the prompt's
    text (and log-probs: None for its first token) before the completion's."""
    choices = []
    for r in results:
        prompt_text = decode(tokenizer, r.prompt_token_ids) if echo and tokenizer else ""
        for s in r.samples:
            text, reason = _text_of(tokenizer, s.token_ids, stops, s.finish_reason)
            choice = {
                "index": len(choices),
                "text": prompt_text + text,
                "finish_reason": reason,
                "logprobs": None,
                "prompt_token_ids": r.prompt_token_ids,
                "token_ids": s.token_ids,
            }
            if logprobs is not None:
                lp = completion_logprobs(tokenizer, s.token_ids, s.logprobs, s.top_logprobs)
                if echo:
                    before = completion_logprobs(
                        tokenizer, r.prompt_token_ids, r.prompt_logprobs, r.prompt_top_logprobs
                    )
                    lp = join_completion_logprobs(before, lp)
                choice["logprobs"] = lp
            choices.append(choice)
    return {
        "id": f"cmpl-{uuid.uuid4().hex}",
        "object": "text_completion",
        "created": int(time.time()),
        "model": model_name,
        "choices": choices,
        "usage": usage(results),
        "weight_version": results[0].weight_version,
    }


def completion_logprobs(
    tokenizer,
    ids: list[int],
    logprobs: list[float | None] | None,
    tops: list | None,
    offset: int = 0,
) -> dict[str, Any]:
    """OpenAI's completions log-probs of `ids`: token texts, their log-probs, per position a dict
    of the top-k texts (the sampled token's included, as OpenAI does) or None without top-k,
    and each token's character offset in the text (from `offset`)."""
    pieces = _token_strings(tokenizer, ids)
    offsets, at = [], offset
    for p in pieces:
        offsets.append(at)
        at += len(p)
    top_dicts = None
    if tops is not None:
        top_dicts = []
        for piece, lp, top in zip(pieces, logprobs, tops):
            if top is None:  # the prompt's first token
                top_dicts.append(None)
                continue
            d: dict[str, float] = {}
            for t, v in top:  # descending: a text shared by several tokens keeps the likeliest
                d.setdefault(_token_string(tokenizer, t), v)
            d.setdefault(piece, lp)
            top_dicts.append(d)
    return {
        "tokens": pieces,
        "token_logprobs": list(logprobs) if logprobs is not None else [None] * len(ids),
        "top_logprobs": top_dicts,
        "text_offset": offsets,
    }


def join_completion_logprobs(first: dict[str, Any], then: dict[str, Any]) -> dict[str, Any]:
    """The log-probs of `first`'s tokens followed by `then`'s (echo: prompt, then completion)."""
    shift = sum(len(p) for p in first["tokens"])
    tops = None
    if first["top_logprobs"] is not None or then["top_logprobs"] is not None:
        tops = (first["top_logprobs"] or [None] * len(first["tokens"])) + (
            then["top_logprobs"] or [None] * len(then["tokens"])
        )
    return {
        "tokens": first["tokens"] + then["tokens"],
        "token_logprobs": first["token_logprobs"] + then["token_logprobs"],
        "top_logprobs": tops,
        "text_offset": first["text_offset"] + [o + shift for o in then["text_offset"]],
    }


def chat_logprobs(
    tokenizer, ids: list[int], logprobs: list[float], tops: list | None
) -> list[dict[str, Any]]:
    """OpenAI's chat log-probs `content`: per token its text, log-prob, UTF-8 bytes and its top-k
    alternatives ([] without top-k)."""
    content = []
    for i, (piece, lp) in enumerate(zip(_token_strings(tokenizer, ids), logprobs)):
        alternatives = []
        for t, v in tops[i] if tops is not None else ():
            text = _token_string(tokenizer, t)
            alternatives.append({"token": text, "logprob": v, "bytes": list(text.encode())})
        content.append(
            {
                "token": piece,
                "logprob": lp,
                "bytes": list(piece.encode()),
                "top_logprobs": alternatives,
            }
        )
    return content


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
                "content": chat_logprobs(tokenizer, s.token_ids, s.logprobs, s.top_logprobs)
            }
        choices.append(choice)
    return {
        "id": f"chatcmpl-{uuid.uuid4().hex}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model_name,
        "choices": choices,
        "usage": usage([result]),
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
    return [_token_string(tokenizer, t) for t in ids]


def _token_string(tokenizer, token: int) -> str:
    return decode(tokenizer, [token]) if tokenizer is not None else ""


def usage(results: list[GenerationResult]) -> dict[str, Any]:
    prompt = sum(len(r.prompt_token_ids) for r in results)
    completion = sum(len(s.token_ids) for r in results for s in r.samples)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": sum(r.cached_tokens for r in results)},
    }

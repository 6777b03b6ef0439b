"""Streamed responses (`stream: true`): server-sent events as OpenAI and vLLM send them.

Every event is `data: <json chunk>\\n\\n`; the stream ends with `data: [DONE]\\n\\n`. A chunk
carries, per choice that advanced, its new text, the new token ids (`token_ids`, ours: exactly
what was sampled) and their log-probs when asked; a choice's last chunk carries its finish reason.
With `stream_options.include_usage` a last chunk has no choices and the usage.

Text is decoded incrementally (`TextDelta`: only the new tokens, in the context of the few before
them) and the part not yet sent goes out, holding back an incomplete UTF-8 character and, with
stop strings, the characters a stop string could still claim; a choice's last delta decodes its
whole sample, so the concatenated deltas equal the non-streamed text.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

from rollout.async_engine import GenerationResult, TokenDelta
from rollout.serving.openai_api import (
    chat_logprobs,
    chat_message,
    completion_logprobs,
    usage,
)
from rollout.stop_strings import cut_at_stop, decode

DONE = "data: [DONE]\n\n"


def event(chunk: dict[str, Any]) -> str:
    return f"data: {json.dumps(chunk, ensure_ascii=False)}\n\n"


class TextDelta:
    """One choice's text as its tokens arrive: `add` returns the text not sent before.

    The text is decoded incrementally, as vLLM's detokenizer does: each step decodes only the
    tokens from `prefix` on, once with and once without the tokens not yet read into `text`,
    and the difference is the new text (the few tokens before them keep what decoding a word
    mid-sequence means, e.g. a leading space); a tail ending in an incomplete UTF-8 character
    waits for its bytes. The last `add` decodes the whole sample, which is what the non-streamed
    response returns."""

    def __init__(self, tokenizer, stops: list[str]):
        self.tokenizer, self.stops = tokenizer, stops
        self.hold = max((len(s) for s in stops), default=1) - 1
        self.ids: list[int] = []
        self.text = ""  # the decoded text of ids[:read]
        self.prefix = 0  # ids[prefix:read]: the context the next tokens are decoded in
        self.read = 0
        self.sent = 0  # characters sent
        self.chars = 0  # characters of the token pieces so far (log-prob text offsets)

    def add(self, ids: list[int], final: bool) -> str:
        self.ids.extend(ids)
        if self.tokenizer is None:
            return ""
        if final:
            self.text = decode(self.tokenizer, self.ids)
            self.prefix = self.read = len(self.ids)
        else:
            self._read()
        text, cut = cut_at_stop(self.text, self.stops) if self.stops else (self.text, False)
        if not final and not cut:
            text = text[: max(len(text) - self.hold, self.sent)]
        new = text[self.sent :]
        self.sent = max(self.sent, len(text))
        return new

    def _read(self) -> None:
        """The tokens after `read` into `text`, unless they end in an incomplete character."""
        if self.read == len(self.ids):
            return
        window = self.ids[self.prefix :]
        before = decode(self.tokenizer, window[: self.read - self.prefix])
        after = decode(self.tokenizer, window)
        if len(after) > len(before) and not after.endswith("\ufffd"):
            self.text += after[len(before) :]
            self.prefix, self.read = self.read, len(self.ids)


async def merged(
    streams: list[AsyncIterator[TokenDelta | GenerationResult]],
) -> AsyncIterator[tuple[int, TokenDelta | GenerationResult]]:
    """The items of several streams as they come, each with its stream's index. Closing this
    iterator closes every stream (which aborts their requests)."""
    if len(streams) == 1:  # nothing to merge: no pump task and queue hop per item
        (only,) = streams
        try:
            async for item in only:
                yield 0, item
        finally:
            await only.aclose()
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, stream) -> None:
        try:
            async for item in stream:
                await queue.put((i, item))
            await queue.put((i, None))
        except BaseException as exc:  # noqa: BLE001 -- re-raised by the consumer
            await queue.put((i, exc))
            raise

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    live = len(tasks)
    try:
        while live:
            i, item = await queue.get()
            if item is None:
                live -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def sse(
    first: tuple[int, TokenDelta | GenerationResult] | None,
    items: AsyncIterator[tuple[int, TokenDelta | GenerationResult]],
    chunk_of: Callable[[int, TokenDelta], dict[str, Any] | None],
    finish: Callable[[list[GenerationResult]], list[dict[str, Any]]],
    num_streams: int,
) -> AsyncIterator[str]:
    """The events of a streamed response: one chunk per delta (`chunk_of`), then `finish`'s
    chunks once every request's result is in, then [DONE]. `first`: an item already taken from
    `items` (to answer errors before the response starts)."""
    results: list[GenerationResult | None] = [None] * num_streams
    try:
        pending = [first] if first is not None else []
        while True:
            if pending:
                i, item = pending.pop()
            else:
                try:
                    i, item = await anext(items)
                except StopAsyncIteration:
                    break
            if isinstance(item, GenerationResult):
                results[i] = item
            elif (chunk := chunk_of(i, item)) is not None:
                yield event(chunk)
        for chunk in finish([r for r in results if r is not None]):
            yield event(chunk)
        yield DONE
    finally:
        await items.aclose()


class CompletionStream:
    """The chunks of a streamed `/v1/completions`: choice p * n + j is sample j of prompt p."""

    def __init__(self, model: str, tokenizer, stops, n: int, logprobs: int | None, usage_: bool):
        self.id, self.created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        self.model, self.tokenizer, self.stops, self.n = model, tokenizer, stops, n
        self.logprobs, self.include_usage = logprobs, usage_
        self.texts: dict[int, TextDelta] = {}

    def _chunk(self, choices: list[dict[str, Any]], **extra) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": choices,
            **extra,
        }

    def chunk_of(self, prompt_index: int, d: TokenDelta) -> dict[str, Any] | None:
        index = prompt_index * self.n + d.sample_index
        text = self.texts.setdefault(index, TextDelta(self.tokenizer, self.stops))
        offset = text.chars
        piece = text.add(d.token_ids, d.finish_reason is not None)
        reason = d.finish_reason
        if reason is not None and self.stops and text.tokenizer is not None:
            if cut_at_stop(decode(self.tokenizer, text.ids), self.stops)[1]:
                reason = "stop"
        choice: dict[str, Any] = {
            "index": index,
            "text": piece,
            "logprobs": None,
            "finish_reason": reason,
            "token_ids": d.token_ids,
        }
        if self.logprobs is not None and d.token_ids:
            lp = completion_logprobs(
                self.tokenizer, d.token_ids, d.logprobs, d.top_logprobs, offset
            )
            text.chars = offset + sum(len(p) for p in lp["tokens"])
            choice["logprobs"] = lp
        return self._chunk([choice])

    def finish(self, results: list[GenerationResult]) -> list[dict[str, Any]]:
        if not self.include_usage:
            return []
        return [self._chunk([], usage=usage(results), weight_version=results[-1].weight_version)]


class ChatStream:
    """The chunks of a streamed `/v1/chat/completions`: the first of each choice carries the
    assistant role. With `tools` the text is held back to the end, where it is parsed for tool
    calls as the non-streamed message is (token ids still stream as they come)."""

    def __init__(self, model: str, tokenizer, stops, logprobs: bool, tools: bool, usage_: bool):
        self.id, self.created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        self.model, self.tokenizer, self.stops = model, tokenizer, stops
        self.logprobs, self.tools, self.include_usage = logprobs, tools, usage_
        self.texts: dict[int, TextDelta] = {}

    def _chunk(self, choices: list[dict[str, Any]], **extra) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": "chat.completion.chunk",
            "created": self.created,
            "model": self.model,
            "choices": choices,
            **extra,
        }

    def chunk_of(self, _: int, d: TokenDelta) -> dict[str, Any] | None:
        final = d.finish_reason is not None
        text = self.texts.get(d.sample_index)
        delta: dict[str, Any] = {}
        if text is None:
            text = self.texts[d.sample_index] = TextDelta(self.tokenizer, self.stops)
            delta["role"] = "assistant"
        piece = text.add(d.token_ids, final)
        reason = d.finish_reason
        if final and self.stops and self.tokenizer is not None:
            if cut_at_stop(decode(self.tokenizer, text.ids), self.stops)[1]:
                reason = "stop"
        if self.tools:
            piece = ""
            if final:
                full, _ = cut_at_stop(decode(self.tokenizer, text.ids), self.stops)
                message = chat_message(full)
                delta["content"] = message["content"]
                if message.get("tool_calls"):
                    delta["tool_calls"] = [
                        {"index": k, **call} for k, call in enumerate(message["tool_calls"])
                    ]
                    reason = "tool_calls" if reason == "stop" else reason
        if not self.tools or not final:
            delta["content"] = piece
        choice: dict[str, Any] = {
            "index": d.sample_index,
            "delta": delta,
            "logprobs": None,
            "finish_reason": reason,
            "token_ids": d.token_ids,
        }
        if self.logprobs:
            choice["logprobs"] = {
                "content": chat_logprobs(self.tokenizer, d.token_ids, d.logprobs, d.top_logprobs)
            }
        return self._chunk([choice])

    def finish(self, results: list[GenerationResult]) -> list[dict[str, Any]]:
        if not self.include_usage:
            return []
        return [self._chunk([], usage=usage(results), weight_version=results[-1].weight_version)]

"""The router's relay of a streamed completion (`rollout.serving.router_app`).

* `sse_lines` splits a byte stream into the lines the server-sent event format defines (ended by
  CRLF, LF or CR only), whatever the chunk boundaries: against the format's own rule applied to
  the whole text, for every chunk size from 1 byte up. U+0085, U+2028 and U+2029 stay inside
  their line (Python's `splitlines`, which httpx's `aiter_lines` uses, would end lines there).
* End to end: a replica streaming completion chunks whose text holds those characters (a byte-level
  vocabulary samples them) reaches a real `openai` client through the router whole. A stand-in
  replica (a FastAPI app speaking the engine server's event format) makes the text known; the
  relay used to cut such an event in two and end the response mid-stream.
"""

from __future__ import annotations

import asyncio
import json

import openai
from fastapi import FastAPI
from fastapi.responses import StreamingResponse

from rollout.serving.router import Router
from rollout.serving.router_app import build_router_app, sse_lines
from rollout.serving.server import start_server

TEXTS = ["a\u2028b", "c\x85d", "e\u2029f", "line\nbreak", "cr\rhere", "é😀"]


def _collect(chunks: list[bytes]) -> list[str]:
    async def run():
        async def gen():
            for c in chunks:
                yield c

        return [line async for line in sse_lines(gen())]

    return asyncio.run(run())


def test_sse_lines_follow_the_format_at_every_chunk_size():
    events = [f"data: {json.dumps({'text': t}, ensure_ascii=False)}" for t in TEXTS]
    text = "\r\n".join(events[:2]) + "\n\n" + "\r".join(events[2:4]) + "\r\n\r\n" + events[4]
    text += "\n" + events[5] + "\r"
    data = text.encode()
    # the format's rule on the whole text: CRLF, then lone CR, are line ends like LF
    want = text.replace("\r\n", "\n").replace("\r", "\n").split("\n")
    want = want[:-1] if want[-1] == "" else want  # the last line's end ends no further line
    for size in range(1, 12):
        chunks = [data[i : i + size] for i in range(0, len(data), size)]
        assert _collect(chunks) == want, size
    assert any("\u2028" in line for line in want)


def _stand_in_replica() -> FastAPI:
    """Streams one completion whose chunks carry TEXTS, in the engine server's event format
    (`data: <json>` events, `data: [DONE]` last); the JSON is not ASCII-escaped, as ours."""
    app = FastAPI()

    @app.post("/v1/completions")
    async def completions():
        def chunk(i: int, text: str, finish=None) -> str:
            body = {
                "id": "cmpl-1",
                "object": "text_completion",
                "created": 0,
                "model": "tiny",
                "choices": [{"index": 0, "text": text, "token_ids": [i], "finish_reason": finish}],
            }
            return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"

        async def events():
            for i, text in enumerate(TEXTS):
                yield chunk(i, text, "length" if i == len(TEXTS) - 1 else None)
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    return app


def test_a_streamed_text_with_unicode_line_separators_arrives_whole():
    replica = start_server(_stand_in_replica())
    front = start_server(build_router_app([replica.url], Router(1)))
    try:
        client = openai.OpenAI(base_url=front.url + "/v1", api_key="none", max_retries=0)
        stream = client.completions.create(
            model="tiny", prompt=[1, 2, 3], max_tokens=6, stream=True
        )
        got = [c.choices[0].text for c in stream if c.choices]
        assert got == TEXTS
    finally:
        front.stop()
        replica.stop()

"""`EventStream` against starlette's `StreamingResponse` on a live uvicorn server, read with httpx:
the same status, headers and body bytes for the same events (one of them several events in one
item); a client gone mid-stream closes the events (what aborts the engine's requests) and the
server goes on serving."""

from __future__ import annotations

import asyncio
import threading

import httpx
import pytest
from fastapi import FastAPI
from fastapi.responses import StreamingResponse

from rollout.serving.server import start_server
from rollout.serving.sse import EventStream

EVENTS = [
    'data: {"id": "x", "choices": [{"text": "h\\u00e9llo \\u2603"}]}\n\n',
    'data: {"id": "x", "choices": [{"text": " world"}]}\n\n',
    'data: {"id": "x", "choices": [], "usage": {"total_tokens": 3}}\n\ndata: [DONE]\n\n',
]


async def _events():
    for e in EVENTS:
        await asyncio.sleep(0)
        yield e


@pytest.fixture(scope="module")
def server():
    app = FastAPI()
    closed = threading.Event()

    async def endless():
        try:
            while True:
                yield "data: {}\n\n"
                await asyncio.sleep(0.01)
        finally:
            closed.set()

    @app.post("/starlette")
    async def old():
        return StreamingResponse(_events(), media_type="text/event-stream")

    @app.post("/ours")
    async def ours():
        return EventStream(_events())

    @app.post("/endless")
    async def forever():
        return EventStream(endless())

    handle = start_server(app)
    yield handle.url, closed
    handle.stop()


def _raw(url: str) -> tuple[int, list[tuple[bytes, bytes]], bytes]:
    with httpx.stream("POST", url) as r:
        body = b"".join(r.iter_raw())
        headers = [(k, v) for k, v in r.headers.raw if k.lower() != b"date"]
        return r.status_code, headers, body


def test_same_bytes_as_starlettes_streaming_response(server):
    url, _ = server
    old, ours = _raw(url + "/starlette"), _raw(url + "/ours")
    assert ours == old
    assert old[0] == 200 and old[2] == "".join(EVENTS).encode()
    assert (b"content-type", b"text/event-stream; charset=utf-8") in old[1]


def test_a_client_gone_mid_stream_closes_the_events(server):
    url, closed = server
    with httpx.stream("POST", url + "/endless") as r:
        first = next(r.iter_raw())
        assert first.startswith(b"data: {}")
    assert closed.wait(10), "the events still run after their client left"
    assert _raw(url + "/ours")[2] == "".join(EVENTS).encode()  # still serving

"""The ASGI response of a streamed route: server-sent events written as they come.

What it sends is what starlette's `StreamingResponse(events, media_type="text/event-stream")`
sends, byte for byte (status 200, one `content-type: text/event-stream; charset=utf-8` header,
no content-length, each event as one body write, an empty last write), at less cost per event:
no task group around every response, one watcher task instead, and each event encoded and sent
straight through.

A client gone mid-stream: the watcher sees `http.disconnect` and cancels the task writing the
response, which closes `events` (closing the engine streams behind it aborts their requests)
and returns as a finished response does (the cancellation is taken back, not propagated).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from starlette.responses import Response

START = {
    "type": "http.response.start",
    "status": 200,
    "headers": [(b"content-type", b"text/event-stream; charset=utf-8")],
}
END = {"type": "http.response.body", "body": b"", "more_body": False}


class EventStream(Response):
    """`events` (`data: ...\\n\\n` strings; one item may hold several events, written at once)
    as the body of a 200 `text/event-stream` response. A `Response` for the framework's sake
    (a route returning one sends it as it is); `Response.__init__`'s body and header handling
    are not used."""

    def __init__(self, events: AsyncIterator[str]):
        self.events = events
        self.status_code = START["status"]
        self.background = None  # the framework may set a route's background tasks here

    async def __call__(self, scope, receive, send) -> None:
        writer = asyncio.current_task()
        state = {"gone": False, "ended": False}

        async def watch() -> None:
            while (await receive())["type"] != "http.disconnect":
                pass
            # After the last write the server answers `receive` with a disconnect too: only a
            # client gone before it cancels the writer.
            if not state["ended"]:
                state["gone"] = True
                writer.cancel()

        watcher = asyncio.create_task(watch())
        try:
            await send(START)
            async for text in self.events:
                await send({"type": "http.response.body", "body": text.encode(), "more_body": True})
            state["ended"] = True
            await send(END)
        except asyncio.CancelledError:
            if not state["gone"] or writer.uncancel() > 0:
                raise  # cancelled from elsewhere (server shutdown): not ours to swallow
        finally:
            state["ended"] = True
            watcher.cancel()
            await self.events.aclose()
        if self.background is not None:
            await self.background()

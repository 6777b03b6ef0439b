"""The router's HTTP front: one OpenAI-compatible URL in front of several engine endpoints.

`POST /v1/completions` and `/v1/chat/completions` are tokenized here (the prompt's token ids choose
the replica: `rollout.serving.router.Router`) and proxied with httpx to the chosen replica's
`rollout.serving.server` endpoint; its answer (or its error, e.g. 503 while weights update) goes
back unchanged. With a session id (body field `session_id` or header `X-Session-Id`) every call's
exact prompt token ids, completion token ids, log-probs and weight version are recorded: `GET
/v1/sessions/{id}` (or `Sessions.get` in-process) returns them. That is how turns of external agent
code become training data without re-tokenizing anything.

`stream: true` is relayed event by event from the replica (not with a session id: a session's
turns are recorded from whole responses). With an API key (`--api-key`, `rollout.api_key`) every
route but `/health` needs `Authorization: Bearer <key>`, and the router may bind beyond loopback
(`rollout.serving.auth`); `replica_api_key` is what the router sends its replicas.

    python -m rollout.serving.router_app --replica URL [--replica URL ...] [--host H] \
        [--port P] [--api-key KEY] [--replica-api-key KEY] [--tokenizer MODEL_DIR]
"""

from __future__ import annotations

import argparse
import json
import re
import threading
from collections.abc import AsyncIterator, Sequence
from typing import Annotated, Any, NamedTuple

import httpx
from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from rollout.serving.auth import check_bind, require_api_key
from rollout.serving.openai_api import error_response
from rollout.serving.router import Router


class SessionTurn(NamedTuple):
    prompt_token_ids: list[int]
    token_ids: list[int]  # the completion, exactly as sampled
    logprobs: list[float]  # the engine's, one per completion token
    weight_version: int
    finish_reason: str
    replica: int


class Sessions:
    """Every served turn of every session, in arrival order (thread-safe)."""

    def __init__(self):
        self._turns: dict[str, list[SessionTurn]] = {}
        self._lock = threading.Lock()

    def add(self, session_id: str, turns: Sequence[SessionTurn]) -> None:
        with self._lock:
            self._turns.setdefault(session_id, []).extend(turns)

    def get(self, session_id: str) -> list[SessionTurn] | None:
        with self._lock:
            turns = self._turns.get(session_id)
            return list(turns) if turns is not None else None

    def pop(self, session_id: str) -> list[SessionTurn] | None:
        with self._lock:
            return self._turns.pop(session_id, None)


def _prompt_ids(path: str, body: dict[str, Any], tokenizer) -> list[int]:
    """The token ids the replica will see, as far as the router can tell (routing only: the
    recorded ids are the replica's own). Unknown shapes route as an empty prompt."""
    try:
        if path == "chat/completions":
            if tokenizer is None:
                return []
            return list(
                tokenizer.apply_chat_template(
                    body["messages"],
                    tools=body.get("tools"),
                    add_generation_prompt=True,
                    tokenize=True,
                    return_dict=False,
                )
            )
        prompt = body["prompt"]
        if isinstance(prompt, str):
            return tokenizer.encode(prompt, add_special_tokens=False) if tokenizer else []
        if prompt and isinstance(prompt[0], int):
            return list(prompt)
        return []  # a batch of prompts: route by nothing
    except Exception:  # noqa: BLE001 -- a malformed body is the replica's to reject, by name
        return []


def _logprobs_of(path: str, choice: dict[str, Any]) -> list[float]:
    lp = choice.get("logprobs") or {}
    if path == "chat/completions":
        return [t["logprob"] for t in lp.get("content") or []]
    return list(lp.get("token_logprobs") or [])


class RouterFront(NamedTuple):
    """What the router's routes work with (`request.app.state.front`)."""

    urls: list[str]  # the replicas' base URLs, by replica index
    router: Router
    tokenizer: Any  # for routing by prompt tokens; None: route token-id prompts only
    sessions: Sessions
    client: httpx.AsyncClient


def build_router_app(
    urls: Sequence[str],
    router: Router,
    tokenizer=None,
    sessions: Sessions | None = None,
    timeout_s: float = 600.0,
    api_key: str | None = None,
    replica_api_key: str | None = None,
) -> FastAPI:
    """The front over replicas `urls` (base URLs of `rollout.serving.server` endpoints).
    `api_key`: required of every request but /health; `replica_api_key`: sent to the
    replicas."""
    if len(urls) != router.num_replicas:
        raise ValueError(f"{len(urls)} replica URLs for a router over {router.num_replicas}")
    sessions = sessions if sessions is not None else Sessions()
    headers = {"authorization": f"Bearer {replica_api_key}"} if replica_api_key else None
    client = httpx.AsyncClient(
        timeout=timeout_s, limits=httpx.Limits(max_connections=None), headers=headers
    )
    app = FastAPI(title="miles_like router")
    require_api_key(app, api_key)
    app.state.front = RouterFront(
        [u.rstrip("/") for u in urls], router, tokenizer, sessions, client
    )
    app.state.sessions, app.state.router = sessions, router
    app.include_router(front_routes)
    return app


async def router_front(request: Request) -> RouterFront:
    # async: FastAPI runs a plain function dependency in a worker thread, once per request
    return request.app.state.front


Front = Annotated[RouterFront, Depends(router_front)]
front_routes = APIRouter()


@front_routes.post("/v1/completions")
async def completions(request: Request, front: Front):
    return await proxy(front, "completions", request)


@front_routes.post("/v1/chat/completions")
async def chat_completions(request: Request, front: Front):
    return await proxy(front, "chat/completions", request)


@front_routes.get("/v1/sessions/{session_id}")
async def session(session_id: str, front: Front):
    turns = front.sessions.get(session_id)
    if turns is None:
        return error_response(
            404,
            f"no session {session_id!r} was recorded",
            "session_id",
            code="session_not_found",
        )
    return {"session_id": session_id, "turns": [t._asdict() for t in turns]}


@front_routes.get("/v1/models")
async def models(front: Front):
    return (await front.client.get(f"{front.urls[0]}/v1/models")).json()


@front_routes.get("/health")
async def health(front: Front):
    codes = []
    for url in front.urls:
        try:
            codes.append((await front.client.get(f"{url}/health")).status_code)
        except httpx.HTTPError:
            codes.append(None)
    ok = sum(c == 200 for c in codes)
    return JSONResponse(
        status_code=200 if ok else 503,
        content={"healthy_replicas": ok, "replicas": len(front.urls)},
    )


async def proxy(front: RouterFront, path: str, request: Request):
    """Send the request to the replica the router chooses; record the turns of a session."""
    router, urls = front.router, front.urls
    try:
        body = await request.json()
    except ValueError as exc:
        return error_response(400, f"request body is not valid JSON: {exc}")
    if not isinstance(body, dict):
        return error_response(400, "request body must be a JSON object")
    session_id = body.pop("session_id", None) or request.headers.get("x-session-id")
    if session_id is not None and not isinstance(session_id, str):
        return error_response(400, "session_id must be a string", "session_id")
    asked_logprobs = body.get("logprobs")
    if body.get("stream") is True:
        if session_id is not None:
            return error_response(
                400,
                "stream=true with a session id is not supported (turns are recorded from whole "
                "responses); drop one of them",
                "stream",
            )
        return await relay_stream(front, path, body)
    if session_id is not None:  # sessions record the engine's log-probs of every turn
        body["logprobs"] = True if path == "chat/completions" else 0
    replica = router.choose(_prompt_ids(path, body, front.tokenizer), session_id)
    router.started(replica)
    try:
        upstream = await front.client.post(f"{urls[replica]}/v1/{path}", json=body)
    except httpx.HTTPError as exc:
        return error_response(
            502, f"replica {replica} ({urls[replica]}) failed: {exc!r}", type="upstream_error"
        )
    finally:
        router.finished(replica)
    try:
        out = upstream.json()
    except ValueError:
        return error_response(
            502,
            f"replica {replica} answered {upstream.status_code} without a JSON body",
            type="upstream_error",
        )
    if upstream.status_code != 200:
        return JSONResponse(status_code=upstream.status_code, content=out)
    turns = []
    for choice in out["choices"]:
        router.record(replica, choice["prompt_token_ids"] + choice["token_ids"])
        turns.append(
            SessionTurn(
                choice["prompt_token_ids"],
                choice["token_ids"],
                _logprobs_of(path, choice),
                out["weight_version"],
                choice["finish_reason"],
                replica,
            )
        )
        if session_id is not None and (asked_logprobs is None or asked_logprobs is False):
            choice["logprobs"] = None
    if session_id is not None:
        front.sessions.add(session_id, turns)
        out["session_id"] = session_id
    out["replica"] = replica
    return out


_SSE_LINE_END = re.compile(rb"\r\n|\r|\n")


async def sse_lines(chunks: AsyncIterator[bytes]) -> AsyncIterator[str]:
    """The lines of a server-sent event stream: ended by CRLF, LF or CR only, as the format
    defines them. (httpx's `aiter_lines` also ends a line at U+0085, U+2028 and U+2029, which a
    JSON string carries unescaped: an event whose text holds one would be cut in two.) A CR at
    a chunk's end waits for the next chunk: it may be half of a CRLF."""
    pending = b""
    async for chunk in chunks:
        pending += chunk
        whole = len(pending) - 1 if pending.endswith(b"\r") else len(pending)
        *lines, rest = _SSE_LINE_END.split(pending[:whole])
        pending = rest + pending[whole:]
        for line in lines:
            yield line.decode()
    if pending:
        yield pending.removesuffix(b"\r").decode()


async def relay_stream(front: RouterFront, path: str, body: dict[str, Any]):
    """A streamed request sent to the chosen replica, its events relayed as they come; the
    router's tree learns the prompt and the streamed token ids."""
    router, urls = front.router, front.urls
    prompt_ids = _prompt_ids(path, body, front.tokenizer)
    replica = router.choose(prompt_ids, None)
    router.started(replica)
    try:
        upstream = await front.client.send(
            front.client.build_request("POST", f"{urls[replica]}/v1/{path}", json=body),
            stream=True,
        )
    except httpx.HTTPError as exc:
        router.finished(replica)
        return error_response(
            502, f"replica {replica} ({urls[replica]}) failed: {exc!r}", type="upstream_error"
        )
    if upstream.status_code != 200:
        try:
            content = json.loads(await upstream.aread())
        except ValueError:
            content = {"error": {"message": f"replica {replica} answered {upstream.status_code}"}}
        finally:
            await upstream.aclose()
            router.finished(replica)
        return JSONResponse(status_code=upstream.status_code, content=content)

    async def events():
        sampled: dict[int, list[int]] = {}
        try:
            async for line in sse_lines(upstream.aiter_bytes()):
                if line.startswith("data: {"):
                    for choice in json.loads(line[6:]).get("choices", ()):
                        sampled.setdefault(choice["index"], []).extend(choice.get("token_ids", ()))
                if line:
                    yield f"{line}\n\n"
        finally:
            await upstream.aclose()
            router.finished(replica)
            for ids in sampled.values():
                router.record(replica, prompt_ids + ids)

    return StreamingResponse(events(), media_type="text/event-stream")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(
        prog="python -m rollout.serving.router_app",
        description="One OpenAI-compatible URL in front of several engine servers.",
    )
    ap.add_argument("--replica", action="append", required=True, help="an engine's base URL")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8080)
    ap.add_argument("--policy", default="cache_aware", choices=("cache_aware", "round_robin"))
    ap.add_argument("--tokenizer", default=None, help="model directory: route text prompts too")
    ap.add_argument(
        "--api-key",
        default=None,
        help="require 'Authorization: Bearer KEY' on every route but /health; needed to bind "
        "anything but loopback",
    )
    ap.add_argument("--replica-api-key", default=None, help="the key the replicas require")
    args = ap.parse_args(argv)
    try:
        check_bind(args.host, args.api_key, "--api-key")
    except ValueError as exc:
        ap.exit(2, f"{ap.prog}: error: {exc}\n")
    import uvicorn

    from rollout.serving.router import RouterConfig
    from rollout.serving.server import load_tokenizer

    tokenizer = load_tokenizer(args.tokenizer) if args.tokenizer else None
    router = Router(len(args.replica), RouterConfig(args.policy))
    app = build_router_app(
        args.replica,
        router,
        tokenizer,
        api_key=args.api_key,
        replica_api_key=args.replica_api_key,
    )
    uvicorn.run(app, host=args.host, port=args.port, log_level="info")


if __name__ == "__main__":
    main()

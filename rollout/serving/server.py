"""The engine as an OpenAI-compatible HTTP service (FastAPI + uvicorn).

    python -m rollout.serving.server MODEL_DIR [--host 127.0.0.1] [--port 8000] \
        [--dtype float32] [--api-key KEY] ...

`build_app` puts the routes (`rollout.serving.routes`) over one `AsyncEngine`; the API's shapes
and errors are `rollout.serving.openai_api`'s. A bad request answers 4xx in OpenAI's error shape
naming the field, and the server keeps serving. With an API key every route but `/health` needs
`Authorization: Bearer <key>`; without one the server binds loopback only (`rollout.serving.auth`).

fastapi, uvicorn and transformers are imported under `rollout.serving` only (the engine itself
needs torch alone).
"""

from __future__ import annotations

import argparse
import socket
import sys
import threading
import time
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError

from rollout.async_engine import AsyncEngine
from rollout.serving import routes
from rollout.serving.auth import check_bind, require_api_key
from rollout.serving.openai_api import APIError, error_response, validation_error
from rollout.serving.prefilled import Prefill

__all__ = ["build_app", "error_response", "load_tokenizer", "main", "start_server"]

SWITCH_INTERVAL_S = 0.001  # the GIL's hand-over interval in a served process (Python's: 5 ms)


def load_tokenizer(model_dir: str | Path):
    """The model directory's Hugging Face tokenizer (local files only), or None if it has none."""
    model_dir = Path(model_dir)
    if not any((model_dir / f).exists() for f in ("tokenizer.json", "tokenizer_config.json")):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)


def build_app(
    async_engine: AsyncEngine,
    tokenizer,
    model_name: str,
    api_key: str | None = None,
    prefill: Prefill | None = None,
) -> FastAPI:
    """The OpenAI-compatible app over `async_engine`. Without a tokenizer, completions take
    token-id prompts only and return empty text (token ids are always returned). `api_key`:
    required of every request but /health. `prefill`: prefill-decode disaggregation, the
    prompts computed there and decoded here (`rollout.serving.prefilled`)."""
    app = FastAPI(title="miles_like engine")
    state = app.state.serving = routes.ServingState.of(async_engine, tokenizer, model_name, prefill)

    app.add_middleware(CountRequests, metrics=state.metrics)
    require_api_key(app, api_key)  # outermost: a refused request is not counted
    app.add_exception_handler(APIError, _api_error)
    app.add_exception_handler(RequestValidationError, _invalid)
    app.add_exception_handler(Exception, _internal)
    app.include_router(routes.engine_routes)
    return app


class CountRequests:
    """ASGI middleware counting answered requests by matched route and status (unmatched paths
    are not counted: the label set stays bounded). Plain ASGI rather than `@app.middleware`:
    that one relays every streamed chunk through a memory stream of its own."""

    def __init__(self, app, metrics):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def counting_send(message):
            if message["type"] == "http.response.start":
                route = scope.get("route")  # set in place by the router once it matched
                if route is not None:
                    self.metrics.request(route.path, message["status"])
            await send(message)

        await self.app(scope, receive, counting_send)


async def _api_error(_: Request, exc: APIError):
    return exc.response()


async def _invalid(_: Request, exc: RequestValidationError):
    return validation_error(exc)


async def _internal(_: Request, exc: Exception):
    return error_response(500, f"internal error: {exc!r}", type="internal_error")


# -- running it --------------------------------------------------------------------------------
class ServerHandle:
    """A uvicorn server running in a daemon thread (see `start_server`)."""

    def __init__(self, server, thread: threading.Thread, url: str):
        self.server, self.thread, self.url = server, thread, url

    def stop(self, timeout: float = 10.0) -> None:
        self.server.should_exit = True
        self.thread.join(timeout)


def start_server(
    app: FastAPI, host: str = "127.0.0.1", port: int = 0, key_setting: str = "--api-key"
) -> ServerHandle:
    """Serve `app` on (host, port) in a thread (port 0: a free one); returns once it accepts.
    A host other than loopback needs the app built with an API key (else one `ValueError`
    line naming `key_setting`)."""
    import uvicorn

    check_bind(host, getattr(app.state, "api_key", None), key_setting)

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    server = uvicorn.Server(
        uvicorn.Config(app, log_level="warning", lifespan="off", timeout_keep_alive=30)
    )
    thread = threading.Thread(
        target=server.run, kwargs={"sockets": [sock]}, daemon=True, name="uvicorn"
    )
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError(f"the HTTP server on {host}:{port} did not start")
        time.sleep(0.01)
    bound_host, bound_port = sock.getsockname()[:2]
    return ServerHandle(server, thread, f"http://{bound_host}:{bound_port}")


def main(argv: list[str] | None = None) -> None:
    from rollout.config import DTYPES, EngineConfig
    from rollout.engine import Engine

    ap = argparse.ArgumentParser(
        prog="python -m rollout.serving.server",
        description="Serve a local model with an OpenAI-compatible API.",
    )
    ap.add_argument("model_dir")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--model-name", default=None, help="default: the directory's name")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32", choices=DTYPES)
    ap.add_argument("--kv-cache-tokens", type=int, default=None)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--max-running-requests", type=int, default=256)
    ap.add_argument("--max-prefill-tokens", type=int, default=4096)
    ap.add_argument("--max-model-len", type=int, default=None)
    ap.add_argument(
        "--api-key",
        default=None,
        help="require 'Authorization: Bearer KEY' on every route but /health; needed to bind "
        "anything but loopback",
    )
    args = ap.parse_args(argv)
    try:
        check_bind(args.host, args.api_key, "--api-key")
    except ValueError as exc:
        ap.exit(2, f"{ap.prog}: error: {exc}\n")
    import uvicorn

    engine = Engine(
        EngineConfig(
            model_path=args.model_dir,
            device=args.device,
            dtype=args.dtype,
            kv_cache_tokens=args.kv_cache_tokens,
            page_size=args.page_size,
            max_running_requests=args.max_running_requests,
            max_prefill_tokens=args.max_prefill_tokens,
            max_model_len=args.max_model_len,
        )
    )
    async_engine = AsyncEngine(engine)
    name = args.model_name or Path(args.model_dir).resolve().name
    app = build_app(async_engine, load_tokenizer(args.model_dir), name, args.api_key)
    # The step loop's thread is the server's critical path: between two torch ops it needs the
    # GIL back promptly, not after the event loop's thread has run for a whole switch interval.
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    try:
        uvicorn.run(app, host=args.host, port=args.port, log_level="info")
    finally:
        async_engine.close()


if __name__ == "__main__":
    main()

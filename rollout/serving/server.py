"""The engine as an OpenAI-compatible HTTP service (FastAPI + uvicorn).

    python -m rollout.serving.server MODEL_DIR [--host 127.0.0.1] [--port 8000] \
        [--dtype float32] ...

Routes: `/v1/completions`, `/v1/chat/completions`, `/v1/models`, `/health`. Every request goes
through one `AsyncEngine`, so concurrent clients are continuously batched by the engine's own
step loop. Token in, token out: `prompt` may be token ids, and every choice carries the exact
`prompt_token_ids` and completion `token_ids` the engine saw and sampled; the response carries
the `weight_version` that sampled them and `usage.prompt_tokens_details.cached_tokens` (prompt
tokens taken from the prefix cache). While the engine is paused (weights or memory are being
changed) every generation answers 503. A bad request answers 4xx in OpenAI's error shape naming
the field, and the server keeps serving.

fastapi, uvicorn and transformers are imported here only (the engine itself needs torch alone).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import threading
import time
import uuid
from pathlib import Path
from typing import Annotated, Any, Literal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt

from rollout.async_engine import AsyncEngine, EngineUnavailable, GenerationResult
from rollout.chat import ToolCallError, parse_tool_calls
from rollout.config import SamplingParams
from rollout.stop_strings import cut_at_stop, decode, make_stop_check

PAUSED_MESSAGE = "engine is updating weights; retry"
MAX_LOGPROBS = 0  # only the sampled token's log-prob (engine semantics); no top-k alternatives


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


# -- request bodies ----------------------------------------------------------------------------
NonNegInt = Annotated[StrictInt, Field(ge=0)]


class _Sampling(BaseModel):
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


class CompletionRequest(_Sampling):
    prompt: str | list[NonNegInt] | list[str] | list[list[NonNegInt]]
    logprobs: StrictInt | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: Literal[False] = False


class ChatRequest(_Sampling):
    messages: list[dict[str, Any]] = Field(min_length=1)
    tools: list[dict[str, Any]] | None = None
    logprobs: StrictBool = False
    top_logprobs: StrictInt | None = Field(None, ge=0, le=MAX_LOGPROBS)
    max_completion_tokens: StrictInt | None = Field(None, ge=1)


# -- the app -----------------------------------------------------------------------------------
def load_tokenizer(model_dir: str | Path):
    """The model directory's Hugging Face tokenizer (local files only), or None if it has none."""
    model_dir = Path(model_dir)
    if not any((model_dir / f).exists() for f in ("tokenizer.json", "tokenizer_config.json")):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)


def build_app(async_engine: AsyncEngine, tokenizer, model_name: str) -> FastAPI:
    """The OpenAI-compatible app over `async_engine`. Without a tokenizer, completions take
    token-id prompts only and return empty text (token ids are always returned)."""
    engine = async_engine.engine
    max_len = engine.max_model_len
    max_n = engine.config.max_running_requests
    app = FastAPI(title="miles_like engine")

    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError):
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError):
        return validation_error(exc)

    @app.exception_handler(Exception)
    async def _internal(_: Request, exc: Exception):
        return error_response(500, f"internal error: {exc!r}", type="internal_error")

    @app.get("/health")
    async def health():
        if not async_engine.is_open:
            return error_response(503, PAUSED_MESSAGE, type="service_unavailable")
        return {"status": "ok", "weight_version": engine.weight_version}

    @app.get("/v1/models")
    async def models():
        return {
            "object": "list",
            "data": [
                {
                    "id": model_name,
                    "object": "model",
                    "created": 0,
                    "owned_by": "miles_like",
                    "max_model_len": max_len,
                }
            ],
        }

    def check_common(
        req: _Sampling, prompts: list[list[int]], prompt_field: str, max_tokens: int | None
    ) -> tuple[SamplingParams, Any]:
        if req.model != model_name:
            raise APIError(
                404,
                f"model {req.model!r} does not exist; this server serves {model_name!r}",
                "model",
                code="model_not_found",
            )
        if req.n > max_n:
            raise APIError(400, f"n={req.n} exceeds this server's limit of {max_n}", "n")
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
        if stops and tokenizer is None:
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

    async def run(
        prompts: list[list[int]], params: SamplingParams, stops: list[str], prompt_field: str
    ) -> list[GenerationResult]:
        check = make_stop_check(tokenizer, stops) if stops else None
        try:  # a cancelled handler aborts its requests in the engine (AsyncEngine.generate)
            return list(
                await asyncio.gather(*(async_engine.generate(p, params, check) for p in prompts))
            )
        except EngineUnavailable as exc:
            raise APIError(
                503,
                PAUSED_MESSAGE if "updating" in str(exc) else str(exc),
                type="service_unavailable",
            ) from None
        except ValueError as exc:  # the engine's check of this request (ids, KV capacity)
            raise APIError(400, str(exc), prompt_field) from None

    def text_of(sample_ids: list[int], stops: list[str], reason: str) -> tuple[str, str]:
        if tokenizer is None:
            return "", reason
        text, cut = cut_at_stop(decode(tokenizer, sample_ids), stops)
        return text, "stop" if cut else reason

    def token_strings(ids: list[int]) -> list[str]:
        return [decode(tokenizer, [t]) for t in ids] if tokenizer is not None else [""] * len(ids)

    def usage(results: list[GenerationResult]) -> dict:
        prompt = sum(len(r.prompt_token_ids) for r in results)
        completion = sum(len(s.token_ids) for r in results for s in r.samples)
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": sum(r.cached_tokens for r in results)},
        }

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest):
        prompts = tokenize_prompts(req.prompt, tokenizer)
        params, stops = check_common(req, prompts, "prompt", req.max_tokens or 16)
        results = await run(prompts, params, stops, "prompt")
        choices = []
        for r in results:
            for s in r.samples:
                text, reason = text_of(s.token_ids, stops, s.finish_reason)
                choice = {
                    "index": len(choices),
                    "text": text,
                    "finish_reason": reason,
                    "logprobs": None,
                    "prompt_token_ids": r.prompt_token_ids,
                    "token_ids": s.token_ids,
                }
                if req.logprobs is not None:
                    pieces = token_strings(s.token_ids)
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
            "usage": usage(results),
            "weight_version": results[0].weight_version,
        }

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatRequest):
        if tokenizer is None:
            raise APIError(
                400,
                "chat needs a tokenizer with a chat template and this server has "
                "none; use /v1/completions with token ids",
                "messages",
            )
        try:
            prompt = list(
                tokenizer.apply_chat_template(
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
        params, stops = check_common(
            req, [prompt], "messages", req.max_completion_tokens or req.max_tokens
        )
        (result,) = await run([prompt], params, stops, "messages")
        choices = []
        for s in result.samples:
            text, reason = text_of(s.token_ids, stops, s.finish_reason)
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
            if req.logprobs:
                choice["logprobs"] = {
                    "content": [
                        {
                            "token": piece,
                            "logprob": lp,
                            "bytes": list(piece.encode()),
                            "top_logprobs": [],
                        }
                        for piece, lp in zip(token_strings(s.token_ids), s.logprobs)
                    ]
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

    return app


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


def validation_error(exc: RequestValidationError) -> JSONResponse:
    """pydantic's first error as one OpenAI-shaped 400 naming the field."""
    err = exc.errors()[0]
    if err.get("type") == "json_invalid":
        return error_response(400, f"request body is not valid JSON: {err.get('msg')}")
    loc = [str(p) for p in err.get("loc", ()) if p != "body"]
    field = loc[0] if loc else None  # the top-level field (deeper parts name union members)
    return error_response(400, f"{field or 'request body'}: {err.get('msg')}", field)


# -- running it --------------------------------------------------------------------------------
class ServerHandle:
    """A uvicorn server running in a daemon thread (see `start_server`)."""

    def __init__(self, server, thread: threading.Thread, url: str):
        self.server, self.thread, self.url = server, thread, url

    def stop(self, timeout: float = 10.0) -> None:
        self.server.should_exit = True
        self.thread.join(timeout)


def start_server(app: FastAPI, host: str = "127.0.0.1", port: int = 0) -> ServerHandle:
    """Serve `app` on (host, port) in a thread (port 0: a free one); returns once it accepts."""
    import uvicorn

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
    args = ap.parse_args(argv)
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
    app = build_app(async_engine, load_tokenizer(args.model_dir), name)
    try:
        uvicorn.run(app, host=args.host, port=args.port, log_level="info")
    finally:
        async_engine.close()


if __name__ == "__main__":
    main()

"""`rollout.serve_http`: the engines as one OpenAI-compatible service for agent code.

Every replica serves `rollout.serving.server` on 127.0.0.1 (`EngineWorker.serve`); in front, in the
controller's process, the cache-aware router (`rollout.serving.router_app`) sends a session to the
replica holding its prefix and records the exact token ids and log-probs of every turn served
under a session id (`sessions`), which is how external agent code's turns become trajectories.
Rollout functions get `base_url` (`ctx.base_url`). Replicas answer 503 outside the rollout window
(`EngineWorker.open` / `close`), so no request sees half-updated weights.
"""

from __future__ import annotations

from urllib.parse import urlparse

import ray

from miles_like.run.calls import start_call, wait_all


class HttpFront:
    def __init__(
        self,
        engines: list,
        tokenizer,
        timeout_s: float,
        host: str = "127.0.0.1",
        api_key: str | None = None,
        prefill_replicas: int = 0,
    ):
        """`host`, `api_key`: the router's (`rollout.http_host`, `rollout.api_key`); the replicas
        stay on loopback, unauthenticated. `prefill_replicas` (prefill-decode): engines[:k]
        only prefill, for the others' endpoints, which the router serves."""
        from rollout.serving.router import Router
        from rollout.serving.router_app import Sessions

        self.timeout_s = timeout_s
        self.tokenizer = tokenizer
        self.host, self.api_key = host, api_key
        self.engines, self.k = engines, prefill_replicas
        prefill = engines[:prefill_replicas] or None
        self.urls = wait_all(
            [
                start_call(f"engine {i}", e, "serve", "127.0.0.1", 0, None, prefill)
                for i, e in enumerate(engines)
                if i >= prefill_replicas
            ],
            timeout_s,
        )
        self.router, self.sessions = Router(len(self.urls)), Sessions()
        self._server = None
        self._start(port=0)

    def _start(self, port: int) -> None:
        from rollout.serving.router_app import build_router_app
        from rollout.serving.server import start_server

        app = build_router_app(
            self.urls,
            self.router,
            self.tokenizer,
            self.sessions,
            timeout_s=self.timeout_s,
            api_key=self.api_key,
        )
        self._server = start_server(app, self.host, port, "rollout.api_key")
        self.base_url = f"{self._server.url}/v1"

    def replace(self, index: int, engine) -> None:
        """Engine `index` was replaced: serve from the new one; the router restarts on the same
        port with the same routing state and sessions. A prefill replica: the decode replicas'
        endpoints prefill on the new one."""
        prefill = self.engines[: self.k] or None
        if index < self.k:
            decoders = self.engines[self.k :]
            ray.get(
                [e.set_prefill_engines.remote(prefill) for e in decoders], timeout=self.timeout_s
            )
            return
        serve = engine.serve.remote("127.0.0.1", 0, None, prefill)
        self.urls[index - self.k] = ray.get(serve, timeout=self.timeout_s)
        port = urlparse(self._server.url).port
        self._server.stop()
        self._start(port)

    def close(self) -> None:
        if self._server is not None:
            self._server.stop()
            self._server = None

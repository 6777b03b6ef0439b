"""`EngineWorker`'s OpenAI-compatible endpoint (`serve`), a mixin of it (it reads the worker's
`async_engine`, `model_path`, `device`, `_server` and `_prefill`). Under prefill-decode
disaggregation a decode replica's endpoint computes no prompt itself: `RemotePrefill` has each
prefilled on a prefill replica (`EngineWorker.prefill_one`) and the handoff decoded here
(`rollout.serving.prefilled`).
"""

from __future__ import annotations

import asyncio
import os

from miles_like.run.handoff_transport import HandoffReceiver
from rollout.serving.router import Router


class EngineEndpoint:
    def serve(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        model_name: str | None = None,
        prefill_engines: list | None = None,
    ) -> str:
        """Start the OpenAI-compatible HTTP endpoint (`rollout.serving.server`) in a thread of
        this actor, on this replica's AsyncEngine (it answers 503 while the window is closed).
        Returns its base URL. The tokenizer comes from the model directory when it has one.
        `prefill_engines`: prefill-decode, the prefill replicas its prompts are computed on."""
        from rollout.serving.server import build_app, load_tokenizer, start_server

        if self._server is None:
            if prefill_engines:
                self._prefill = RemotePrefill(prefill_engines, self.device)
            app = build_app(
                self.async_engine,
                load_tokenizer(self.model_path),
                model_name or os.path.basename(os.path.normpath(self.model_path)),
                prefill=self._prefill,
            )
            self._server = start_server(app, host, port)
        return self._server.url

    def set_prefill_engines(self, engines: list) -> None:
        """The prefill replicas this decode replica's endpoint prefills on (a prefill replica
        was replaced)."""
        if self._prefill is not None:
            self._prefill.engines[:] = engines


class RemotePrefill:
    """A decode replica's endpoint hook (`rollout.serving.prefilled.Prefill`): each prompt
    prefilled on the prefill replica the cache-aware router picks, its handoff copied here
    (`handoff_transport`) and the prefill replica's buffers freed. A prefill replica with its
    window closed refuses (`EngineUnavailable`: the endpoint answers 503)."""

    def __init__(self, engines: list, device):
        self.engines = list(engines)
        self.router = Router(len(engines))
        self.receiver = HandoffReceiver(device)  # the endpoint's loop only

    async def __call__(self, prompt_ids: list[int], params):
        p = self.router.choose(prompt_ids)
        self.router.started(p)
        try:
            engine = self.engines[p]
            counters_ref, shared_ref = engine.prefill_one.remote(prompt_ids, params)
            counters = await asyncio.wrap_future(counters_ref.future())
            shared = await asyncio.wrap_future(shared_ref.future())
            try:
                (handoff,) = self.receiver.open(shared)
            finally:
                engine.release_handoffs.remote(counters["handoff_key"])
        finally:
            self.router.finished(p)
        return handoff

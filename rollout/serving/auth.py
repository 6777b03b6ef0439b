"""API keys, as vLLM checks them: with a key, every route but `/health` needs the header
`Authorization: Bearer <key>` (else 401 in OpenAI's error shape); without one, a server may only
bind a loopback address (`check_bind`), so nothing unauthenticated is reachable from the network.
"""

from __future__ import annotations

import hmac
import ipaddress
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # fastapi is imported by the servers only: the recipe checks `check_bind`
    from fastapi import FastAPI

OPEN_PATHS = frozenset({"/health"})


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: it may resolve to anything
        return False


def check_bind(host: str, api_key: str | None, setting: str = "--api-key") -> None:
    """Refuse (one line naming `setting`) to serve on a non-loopback `host` without a key."""
    if api_key is None and not is_loopback(host):
        raise ValueError(
            f"refusing to serve on {host} without an API key: set {setting}, or bind 127.0.0.1"
        )


def require_api_key(app: FastAPI, api_key: str | None) -> None:
    """Check `Authorization: Bearer <api_key>` on every route of `app` but /health (nothing with
    None). The key is kept as `app.state.api_key` (`start_server` reads it)."""
    app.state.api_key = api_key
    if api_key is None:
        return
    from rollout.serving.openai_api import error_response

    app.add_middleware(BearerKey, expected=f"Bearer {api_key}".encode(), refusal=error_response)


class BearerKey:
    """ASGI middleware answering 401 to an HTTP request without the expected `Authorization`
    header (every path but `OPEN_PATHS`). Plain ASGI rather than `@app.middleware`: that one
    relays every streamed chunk through a memory stream of its own."""

    def __init__(self, app, expected: bytes, refusal):
        self.app, self.expected, self.refusal = app, expected, refusal

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"] not in OPEN_PATHS:
            given = next((v for k, v in scope["headers"] if k == b"authorization"), b"")
            if not hmac.compare_digest(given, self.expected):
                response = self.refusal(
                    401,
                    "missing or incorrect API key: send the header 'Authorization: Bearer <key>'",
                    code="invalid_api_key",
                )
                return await response(scope, receive, send)
        await self.app(scope, receive, send)

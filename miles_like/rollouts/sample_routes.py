"""A mixture of experts' routes of one sample, as the rollouts carry them to the trainer.

With each sample the engine returns the top-k experts of every sparse layer for each token it
computed (`RequestOutput.routed_experts`): rows [0, input + generated - 1) of the request's
sequence, prefix-cache hits giving the routes of the prefill that computed the reused K/V. A
sample's routes grow request by request (the turns of a multi-turn sample, the continuations of
a carried one): the rows it has are kept, the rows past them come from the request that computed
them (a turn's last sampled token and the tokens appended after it are computed by the next
turn's prefill). So every row holds the experts of the forward that computed its token, under
whichever weights that ran: what the trainer replays (`trainer.routing_replay`). A complete
sample has a row for every token but its last.

None stands for no routes: a dense model, or `algorithm.routing_replay: off` (the engines then
return none).
"""

from __future__ import annotations

import base64

import torch


def extend(
    kept: torch.Tensor | None, new: torch.Tensor | None, tokens: int | None = None
) -> torch.Tensor | None:
    """The routes of a sample continued by a request: `kept`, its rows so far (None: no row
    yet), then the rows of `new` past them; `new` the request's routes, for a sequence (the
    request's input and what it generated) of `tokens` tokens (None: not checked)."""
    if new is None:
        if kept is not None and len(kept):
            raise ValueError("a continuation returned no routes for a sample that had some")
        return None
    if new.dim() != 3 or (tokens is not None and new.shape[0] > max(tokens - 1, 0)):
        want = "" if tokens is None else f" for a sequence of {tokens} tokens"
        raise ValueError(
            f"the engine returned routes of shape {tuple(new.shape)}{want}; want "
            "[tokens computed, sparse layers, k]"
        )
    if kept is None or not len(kept):
        return new
    if kept.shape[1:] != new.shape[1:]:
        raise ValueError(
            f"routes of shape {tuple(new.shape)} continue routes of shape {tuple(kept.shape)}"
        )
    return torch.cat([kept, new[len(kept) :].to(kept.dtype)]) if len(new) > len(kept) else kept


def check(routes: torch.Tensor | None, tokens: int, what: str = "routes") -> None:
    """One line unless `routes` fit a complete sample of `tokens` tokens."""
    if routes is None:
        return
    if not isinstance(routes, torch.Tensor) or routes.dim() != 3:
        raise ValueError(f"{what} must be a [tokens - 1, sparse layers, k] tensor or None")
    if routes.shape[0] not in (tokens - 1, tokens):
        raise ValueError(
            f"{what} has {routes.shape[0]} rows for {tokens} tokens; want one per token "
            "the engine computed (every token but the last): pass each turn's "
            "Generation.routes to TrajectoryBuilder.sampled"
        )


def nbytes(routes: torch.Tensor | None) -> int:
    return 0 if routes is None else routes.numel() * routes.element_size()


def to_state(routes: torch.Tensor | None) -> dict | None:
    """JSON-ready and exact: dtype, shape and the raw bytes (base64)."""
    if routes is None:
        return None
    data = routes.detach().cpu().contiguous()
    return {
        "dtype": str(data.dtype).removeprefix("torch."),
        "shape": list(data.shape),
        "data": base64.b64encode(data.numpy().tobytes()).decode("ascii"),
    }


def from_state(row: dict | None) -> torch.Tensor | None:
    if row is None:
        return None
    dtype = getattr(torch, row["dtype"])
    raw = base64.b64decode(row["data"])
    if not raw:  # torch.frombuffer refuses an empty buffer
        return torch.empty(row["shape"], dtype=dtype)
    return torch.frombuffer(bytearray(raw), dtype=dtype).reshape(row["shape"]).clone()

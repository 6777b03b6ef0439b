"""The least arithmetic a generation workload needs, and how long that takes on this machine.

For a decoder-only transformer (Qwen2 / Llama layout: fused-able q, k, v, o projections, a gated
MLP, an untied LM head) and a workload of `prompts` prompts of `prompt_len` tokens, `n` samples
each of exactly `new_tokens` tokens, the floor is the multiply-adds no engine can skip: each
prompt prefilled once (its samples share it), the LM head on each prompt's last position (the
first token of every sample), and every sample's `new_tokens - 1` decode steps (the last sampled
token is never fed back), each attending to every earlier position (causal).

`gemm_rate` measures the best rate of the model's largest GEMM in a dtype on the threads the
benchmark pins, so `floor_seconds = flops / rate` is the time an engine with no overhead at all,
every FLOP (attention's included) at its best GEMM rate, would take. An engine's seconds over
that floor is how far it is from the machine; another engine's seconds over the floor is the
largest speed-up over it any engine could show on that workload.
"""

from __future__ import annotations

import time
from typing import NamedTuple


class Model(NamedTuple):
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int

    # the HF config field each is read from
    CONFIG_KEYS = {
        "hidden": "hidden_size",
        "layers": "num_hidden_layers",
        "heads": "num_attention_heads",
        "kv_heads": "num_key_value_heads",
        "intermediate": "intermediate_size",
        "vocab": "vocab_size",
    }

    def linear_flops(self) -> int:
        """FLOPs of one token through every layer's projections (2 per multiply-add)."""
        h, kv = self.hidden, self.kv_heads * (self.hidden // self.heads)
        per_layer = h * (h + 2 * kv) + h * h + 3 * h * self.intermediate
        return 2 * self.layers * per_layer

    def head_flops(self) -> int:
        """FLOPs of the LM head for one position."""
        return 2 * self.hidden * self.vocab

    def attention_flops(self, keys: int) -> int:
        """FLOPs of one query attending to `keys` positions in every layer: q.k and p.v for each
        query head (grouped K/V heads are read, not recomputed)."""
        return 4 * self.hidden * keys * self.layers


def workload_flops(
    model: Model, prompts: int, prompt_len: int, new_tokens: int, n: int
) -> dict[str, int]:
    """The floor's FLOPs, by part (see the module doc)."""
    prefill_linear = prompts * prompt_len * model.linear_flops()
    prefill_attention = prompts * sum(model.attention_flops(p + 1) for p in range(prompt_len))
    fed = new_tokens - 1  # decode steps of each sample
    decode_linear = prompts * n * fed * model.linear_flops()
    decode_attention = (
        prompts * n * sum(model.attention_flops(prompt_len + t + 1) for t in range(fed))
    )
    head = prompts * (1 + n * fed) * model.head_flops()
    parts = {
        "prefill_linear": prefill_linear,
        "prefill_attention": prefill_attention,
        "decode_linear": decode_linear,
        "decode_attention": decode_attention,
        "lm_head": head,
    }
    parts["total"] = sum(parts.values())
    return parts


def gemm_rate(model: Model, dtype: str, threads: int, rows: int = 4096, repeats: int = 20) -> float:
    """Best FLOP/s of the model's largest GEMM (`rows` tokens through the fused gate and up
    projections) in `dtype` on `threads` threads: the rate the floor is timed at."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        x = torch.randn(rows, model.hidden).to(getattr(torch, dtype))
        w = torch.randn(model.hidden, 2 * model.intermediate).to(x.dtype)
        for _ in range(3):
            torch.mm(x, w)
        best = float("inf")
        for _ in range(repeats):
            start = time.perf_counter()
            torch.mm(x, w)
            best = min(best, time.perf_counter() - start)
    finally:
        torch.set_num_threads(before)
    return 2 * rows * model.hidden * 2 * model.intermediate / best

"""`torch.compile` of the engine's forward outside attention (`EngineConfig.compile`).

The model's forward runs, per layer, two pure tensor functions around the paged attention
(`DecoderLayer.attention_inputs`: RMSNorm, q/k/v projections, q/k-norm, rotary;
`attention_outputs`: o_proj, residual, RMSNorm, SwiGLU MLP, residual) and, at the end, the
logits head (final RMSNorm, LM head, upcast). Eagerly each is a chain of small ops, one pass over
memory each; compiled, inductor fuses the element-wise chains into single loops (C++ / OpenMP on
CPU, Triton on GPU) around the same matrix-multiply library calls. Attention, the KV stores,
suffix lanes and sampling stay eager: their metadata is built in Python per step.

Shapes: every piece is compiled with a dynamic token dimension, so a run compiles each piece
once for any batch (dynamo specialises sizes 0 and 1: a one-token step compiles a second
version), not once per bucket; all layers share one compiled function (parameters are graph
inputs, not constants). Weight updates copy into the parameters in place and are seen by the
next call; `release_memory(weights=True)` swaps the parameters' storage, which the compiled code
reads afresh on every call (its guards check shapes and dtypes, never addresses).

The eager pieces are the reference: compiled code may round differently (fused reductions,
vectorised transcendental functions), so tokens and log-probs agree within a bound, not
bitwise (tests/rollout/test_compiled.py).
"""

from __future__ import annotations

import torch

from rollout.model import CausalLM, DecoderLayer, LayerPieces


def compile_model(model: CausalLM) -> None:
    """Replace the model's pieces with compiled versions (in place; idempotent)."""
    if model.tp is not None:
        raise ValueError(
            "EngineConfig.compile=True is not supported with EngineConfig.tp > 1 "
            "(the row-parallel all-reduce sits inside the compiled pieces); set compile=False"
        )
    eager = LayerPieces(
        DecoderLayer.attention_inputs, DecoderLayer.attention_outputs, CausalLM._logits
    )
    model.pieces = LayerPieces(*(torch.compile(fn, dynamic=True, fullgraph=True) for fn in eager))


def compiled_graphs() -> int:
    """Graphs dynamo has compiled in this process so far (all compiled functions together)."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])

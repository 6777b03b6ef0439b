"""Run the last decoder layer past its attention, the final norm and the LM head on the packed
rows whose logits are read only (`MegatronModel.run(rows=...)`).

The policy reads log-probs at response positions only. A prompt position of the last layer
still feeds that layer's attention its key and value, but nothing computed at it after the
attention (output projection, residual, MLP, final norm, LM head: all row-wise) reaches any
logit that is read. So with rows selected, the last layer's core attention returns the selected
rows of its output (every selected query still attends over all keys of its sequence), the
attention's residual is sliced the same way, and everything after runs on those rows: the model
returns logits [1, n, V] for the n selected positions, in packed order. Row-wise operations
compute the same values on fewer rows (the matrix multiplies may round differently for a
different row count; tests/trainer/test_response_rows.py bounds it against the full forward).

On a fixed RL batch of equal prompt and response lengths this skips half the last layer's
projection and MLP work and half the LM head, forward and backward. Only the last pipeline
stage holds the last layer; other stages are untouched.
"""

from __future__ import annotations

import contextlib

import torch

from trainer.row_gather import gather_rows

_ROWS = "_miles_like_rows"  # attribute of the last layer: the selected rows, or None


def _last_layer(model: torch.nn.Module):
    decoder = getattr(model, "decoder", None)
    layers = getattr(decoder, "layers", None)
    if not getattr(model, "post_process", False) or not layers:
        return None
    return layers[-1]


def install(model: torch.nn.Module) -> bool:
    """Make `model`'s last layer honour `selecting` (in place; idempotent). Returns whether this
    stage has the last layer."""
    layer = _last_layer(model)
    if layer is None:
        return False
    if hasattr(layer, _ROWS):
        return True
    setattr(layer, _ROWS, None)
    attention = layer.self_attention.core_attention
    attend = attention.forward

    def attend_selected(*args, **kwargs):
        out = attend(*args, **kwargs)
        rows = getattr(layer, _ROWS)
        if rows is None:
            return out
        if out.dim() != 2:  # [t, heads * d]: the packed (thd) layout, the only one selected
            raise ValueError("selected rows need packed sequences (qkv_format 'thd')")
        return gather_rows(out, rows)

    attention.forward = attend_selected
    bias_dropout_add = layer.self_attn_bda

    def bda_selected(training, fused):
        add = bias_dropout_add(training, fused)

        def add_selected(x_with_bias, residual, prob):
            rows = getattr(layer, _ROWS)
            if rows is not None:  # residual [t, 1, h] -> the selected [n, 1, h]
                residual = gather_rows(residual, rows)
            return add(x_with_bias, residual, prob)

        return add_selected

    layer.self_attn_bda = bda_selected
    return True


@contextlib.contextmanager
def selecting(model: torch.nn.Module, rows: torch.Tensor | None):
    """Within the block, forwards of `model` (prepared by `install`) compute the last layer's
    output, and so the logits, at packed rows `rows` only ([n] long, increasing, no repeats);
    None: every row."""
    layer = _last_layer(model)
    if layer is None or rows is None:
        yield
        return
    if not hasattr(layer, _ROWS):
        raise RuntimeError("response_rows.install(model) was not called")
    setattr(layer, _ROWS, rows)
    try:
        yield
    finally:
        setattr(layer, _ROWS, None)

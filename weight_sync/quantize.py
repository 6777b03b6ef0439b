"""Quantization at sync time, on the sender: the trainer's exported stream with every linear
weight replaced by its FP8 form (`quantization.quantize`: float8_e4m3fn + float32 block scales,
the scales sent as `<name>_scale_inv`), so the buckets carry about half the bytes of bf16 for
those weights and their checksums cover exactly the bytes the engine copies into its FP8
parameters. The trainer itself never holds FP8: each weight is quantized on its device as it
streams past, and dropped once packed.

Other tensors (embeddings, norms, the router, the LM head, biases) pass through unchanged. An
engine with `quantization="fp8"` takes either form (`rollout.weights.load_weights` quantizes a
full-precision weight with the same function), so a transport that does not quantize (the
disaggregated broadcast) still gives the engine the same weights.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

from quantization import FP8_DTYPE, is_quantized_weight, quantize, scale_name

QUANTIZATIONS = ("fp8",)


def check_quantization(quantization: str | None) -> None:
    if quantization is not None and quantization not in QUANTIZATIONS:
        raise ValueError(
            f"weight sync quantization={quantization!r} is not one of {QUANTIZATIONS} or None"
        )


def quantized_stream(
    named_tensors: Iterable[tuple[str, torch.Tensor]], quantization: str | None
) -> Iterator[tuple[str, torch.Tensor]]:
    """`named_tensors` as the engine holds them under `quantization` (None: unchanged)."""
    check_quantization(quantization)
    for name, tensor in named_tensors:
        if (
            quantization is not None
            and is_quantized_weight(name)
            and tensor.dim() == 2
            and tensor.dtype != FP8_DTYPE
        ):
            quantized = quantize(tensor)
            yield name, quantized.weight
            yield scale_name(name), quantized.scale_inv
        else:
            yield name, tensor
